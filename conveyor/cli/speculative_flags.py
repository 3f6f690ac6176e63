"""The speculative decoding flags (n-gram lookup or a draft model), and vLLM's --speculative-config for them."""

from __future__ import annotations

import argparse
import json

from conveyor.config import QUANTIZATIONS, SPECULATIVE_METHODS, SpeculativeConfig


def add_speculative_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=None,
                       help="speculative decoding: ngram = guess the next tokens from earlier text of the same "
                            "request; draft_model = a smaller model guesses them (--speculative-model); the model "
                            "verifies the guesses in the same step (outputs unchanged; default: off)")
    group.add_argument("--num-speculative-tokens", type=int, default=None,
                       help=f"most guessed tokens per decode (default {SpeculativeConfig.num_speculative_tokens})")
    group.add_argument("--ngram-prompt-lookup-min", type=int, default=None,
                       help=f"shortest tail of the context looked up for a guess "
                            f"(default {SpeculativeConfig.ngram_prompt_lookup_min})")
    group.add_argument("--ngram-prompt-lookup-max", type=int, default=None,
                       help=f"longest tail looked up, tried first (default {SpeculativeConfig.ngram_prompt_lookup_max})")
    group.add_argument("--speculative-model", "--model-draft", default=None, metavar="PATH",
                       help="a draft model (GGUF file or folder) with the same vocabulary as --model: it guesses "
                            "the next tokens and the model verifies them in one step (outputs unchanged; implies "
                            "--speculative draft_model)")
    group.add_argument("--speculative-model-quantization", choices=QUANTIZATIONS, default=None,
                       help="the draft model's weights, as --quantization for the model "
                            f"(default {SpeculativeConfig.speculative_model_quantization})")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='vLLM\'s spelling of the flags above, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' or '
                            '\'{"model": "draft.gguf", "num_speculative_tokens": 5}\'')


# vLLM's --speculative-config keys -> ours.
_SPECULATIVE_CONFIG_KEYS = {"method": "speculative", "num_speculative_tokens": "num_speculative_tokens",
                            "prompt_lookup_min": "ngram_prompt_lookup_min",
                            "prompt_lookup_max": "ngram_prompt_lookup_max", "model": "speculative_model",
                            "quantization": "speculative_model_quantization"}
# The separate flags beside --speculative, each given or None.
SPECULATIVE_FLAGS = ("num_speculative_tokens", "ngram_prompt_lookup_min", "ngram_prompt_lookup_max",
                     "speculative_model", "speculative_model_quantization")


def speculative_options(flags: dict, config_json: str | None) -> dict:
    """The speculative flags given (`flags`, --speculative among them), or their --speculative-config JSON
    (not both)."""
    if config_json is None:
        return flags
    if flags.get("speculative") is not None or len(flags) > 1:
        raise SystemExit("conveyor: error: give --speculative-config or the separate speculative flags, not both")
    try:
        config = json.loads(config_json)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"conveyor: error: --speculative-config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise SystemExit("conveyor: error: --speculative-config takes a JSON object")
    unknown = sorted(set(config) - set(_SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise SystemExit(f"conveyor: error: --speculative-config: unsupported key(s) {', '.join(unknown)} "
                         f"(supported: {', '.join(_SPECULATIVE_CONFIG_KEYS)})")
    method = config.get("method", "draft_model" if "model" in config else None)
    if method not in SPECULATIVE_METHODS:
        raise SystemExit(f"conveyor: error: --speculative-config: method must be one of "
                         f"{', '.join(SPECULATIVE_METHODS)}, got {method!r}")
    return {_SPECULATIVE_CONFIG_KEYS[key]: value for key, value in {**config, "method": method}.items()}
