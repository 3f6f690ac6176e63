"""The `conveyor` command line: vLLM's and llama.cpp's spellings land on the same engine options."""

from __future__ import annotations

import re

import pytest

from conveyor.config import EngineConfig

from conveyor import __version__
from conveyor.cli.flags import engine_options, parse_args


def test_positional_model_and_llama_cpp_aliases() -> None:
    args = parse_args(["serve", "some/model.gguf", "-t", "3", "-np", "8", "-c", "2048"])
    options = engine_options(args)
    assert (options["model"], options["threads"], options["max_num_seqs"], options["max_model_len"]) == \
        ("some/model.gguf", 3, 8, 2048)
    assert engine_options(parse_args(["generate", "hi", "-m", "x.gguf"]))["model"] == "x.gguf"
    assert engine_options(parse_args(["serve", "--device", "cuda", "--enforce-eager"]))["enforce_eager"] is True
    assert engine_options(parse_args(["serve"]))["enforce_eager"] is False
    assert engine_options(parse_args(["serve", "x.gguf", "--model", "x.gguf"]))["model"] == "x.gguf"


def test_model_given_twice_differently_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "a.gguf", "--model", "b.gguf"])
    assert "usage: conveyor serve" in capsys.readouterr().err


def test_unknown_flag_shows_the_subcommand_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--no-such-flag"])
    err = capsys.readouterr().err
    assert "usage: conveyor serve" in err and "unrecognized arguments: --no-such-flag" in err


def test_prefix_caching_and_dtype_spellings() -> None:
    assert engine_options(parse_args(["serve"]))["enable_prefix_caching"] is True
    for flag in ("--no-enable-prefix-caching", "--no-prefix-caching"):
        assert engine_options(parse_args(["serve", flag]))["enable_prefix_caching"] is False
    assert engine_options(parse_args(["serve", "--dtype", "half"]))["dtype"] == "float16"
    assert engine_options(parse_args(["serve", "--dtype", "float"]))["dtype"] == "float32"
    assert engine_options(parse_args(["serve", "--chat-template", "t.jinja"]))["chat_template"] == "t.jinja"


def test_prefix_cache_dir_flags() -> None:
    from conveyor.config import EngineConfig

    config = EngineConfig.from_options(**engine_options(parse_args(
        ["serve", "--prefix-cache-dir", "/tmp/kv", "--prefix-cache-disk-size", "20G"])))
    assert config.cache.prefix_cache_dir == "/tmp/kv" and config.cache.prefix_cache_disk_bytes == 20 * 10**9
    assert EngineConfig.from_options(**engine_options(parse_args(["serve"]))).cache.prefix_cache_dir is None
    with pytest.raises(ValueError, match="prefix_cache_dir needs enable_prefix_caching"):
        EngineConfig.from_options(**engine_options(parse_args(
            ["serve", "--prefix-cache-dir", "/tmp/kv", "--no-prefix-caching"])))
    with pytest.raises(ValueError, match="prefix_cache_disk_size"):
        EngineConfig.from_options(prefix_cache_dir="/tmp/kv", prefix_cache_disk_size="lots")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"conveyor {__version__}"


def test_speculative_flags() -> None:
    options = engine_options(parse_args(["serve", "--speculative", "ngram", "--num-speculative-tokens", "6",
                                         "--ngram-prompt-lookup-min", "1", "--ngram-prompt-lookup-max", "3"]))
    assert (options["speculative"], options["num_speculative_tokens"], options["ngram_prompt_lookup_min"],
            options["ngram_prompt_lookup_max"]) == ("ngram", 6, 1, 3)
    assert engine_options(parse_args(["serve"]))["speculative"] is None
    draft = engine_options(parse_args(["serve", "--model-draft", "d.gguf", "--speculative-model-quantization", "none"]))
    assert (draft["speculative"], draft["speculative_model"], draft["speculative_model_quantization"]) == \
        (None, "d.gguf", "none")
    config = EngineConfig.from_options(**draft)
    assert config.speculative.speculative == "draft_model"   # implied by the draft model
    for bad, says in [({"speculative": "draft_model"}, "needs speculative_model"),
                      ({"speculative": "ngram", "speculative_model": "d.gguf"}, "not of 'ngram'"),
                      ({"speculative_model": "d.gguf", "speculative_model_quantization": "q4"}, "must be one of")]:
        with pytest.raises(ValueError, match=says):
            EngineConfig.from_options(**bad)


def test_speculative_config_json_is_vllms_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    config = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
    options = engine_options(parse_args(["serve", "--speculative-config", config]))
    assert (options["speculative"], options["num_speculative_tokens"], options["ngram_prompt_lookup_min"],
            options["ngram_prompt_lookup_max"]) == ("ngram", 5, 1, 3)
    defaults = engine_options(parse_args(["serve", "--speculative-config", '{"method": "ngram"}']))
    assert defaults["speculative"] == "ngram" and "num_speculative_tokens" not in defaults   # the config's default
    draft = engine_options(parse_args(["serve", "--speculative-config", '{"model": "d.gguf", "num_speculative_tokens": 6}']))
    assert (draft["speculative"], draft["speculative_model"], draft["num_speculative_tokens"]) == \
        ("draft_model", "d.gguf", 6)   # a model alone means a draft model, as in vLLM
    for bad, says in [('{"method": "eagle", "model": "x"}', "method must be one of ngram, draft_model"),
                      ('{"method": "ngram", "draft": 1}', "unsupported key(s) draft"),
                      ('{"method": "ngram"', "not JSON"), ('["ngram"]', "a JSON object")]:
        with pytest.raises(SystemExit, match=re.escape(says)):
            engine_options(parse_args(["serve", "--speculative-config", bad]))
    with pytest.raises(SystemExit, match="not both"):
        engine_options(parse_args(["serve", "--speculative-config", config, "--num-speculative-tokens", "2"]))


def test_default_model_name_drops_the_gguf_extension(tmp_path) -> None:
    from conveyor.model.checkpoint import default_model_name

    file = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    file.write_bytes(b"GGUF")
    assert default_model_name(file) == "SmolLM2-135M-Instruct.Q4_1"
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert default_model_name(folder) == "my-model"


def test_help_shows_defaults_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())   # argparse wraps lines
    assert "port to listen on (0 = any free port) (default: 8000)" in text
    assert "tokens per KV block (default: 16)" in text
    assert "(default: None)" not in text and text.count("(default: 2GiB on the CPU;") == 1


def test_sharing_and_batch_flags() -> None:
    args = parse_args(["serve", "--tenant-weight", "alice=3", "--tenant-weight", "team=b=0.5",
                       "--max-running-per-tenant", "4", "--max-priority-preemptions", "1",
                       "--max-requests-per-tenant", "8", "--state-dir", "/tmp/x"])
    options = engine_options(args)
    assert options["tenant_weights"] == (("alice", 3.0), ("team=b", 0.5))
    assert options["max_running_per_tenant"] == 4 and options["max_priority_preemptions"] == 1
    assert args.max_requests_per_tenant == 8 and args.state_dir == "/tmp/x"
    with pytest.raises(SystemExit):
        engine_options(parse_args(["serve", "--tenant-weight", "alice"]))
    batch = parse_args(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "-np", "4"])
    assert batch.input_file == "in.jsonl" and batch.output_file == "out.jsonl" and batch.max_num_seqs == 4


def test_first_flags_table_names_real_serve_flags_with_their_defaults() -> None:
    from pathlib import Path

    from conveyor.cli.flags import build_parser
    from conveyor.config import DEFAULT_KV_CACHE_MEMORY

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    serving = (root / "docs" / "serving.md").read_text()
    table = serving.split("The flags most users reach for first", 1)[1].split("\n\n", 2)[1]
    flags = set(re.findall(r"`(--[a-z-]+|-[a-z]+)\b", table))
    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("serve"))
    known = {option for action in serve._actions for option in action.option_strings}
    assert {"--model", "--host", "--port", "--threads", "--api-key", "--max-num-seqs", "--kv-cache-memory",
            "--batch-preset"} <= flags
    assert flags <= known, flags - known
    assert f"`{DEFAULT_KV_CACHE_MEMORY}`" in table
    # The first screen keeps its two commands.
    assert readme.index("make run ") < readme.index("make test ") < readme.index("## Using it")


def test_no_prefix_caching_help_reads_right(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    entry = help_text[help_text.index("--no-prefix-caching turn"):][:120]
    assert "prefix caching off" in entry and "default: True" not in entry.split("--speculative")[0]
    # No flag that turns something off reads "(default: True)".
    entry = help_text[help_text.index("--no-core-process run"):][:160]
    assert "default: True" not in entry.split("structured outputs:")[0]


def test_a_missing_model_is_one_clear_line_and_a_hub_id_says_conveyor_never_downloads(tmp_path) -> None:
    import subprocess
    import sys

    from conveyor.errors import ModelLoadError
    from conveyor.model.checkpoint import resolve_model_path

    with pytest.raises(ModelLoadError, match="never downloads models") as hub:
        resolve_model_path("Qwen/Qwen2.5-Coder-0.5B-Instruct")
    assert "hf download Qwen/Qwen2.5-Coder-0.5B-Instruct" in str(hub.value)
    with pytest.raises(ModelLoadError) as missing:
        resolve_model_path("models/nothing-here.gguf")
    assert "never downloads" not in str(missing.value)
    # The default core process must not die on a closed pipe after the front has said why.
    run = subprocess.run([sys.executable, "-m", "conveyor", "serve", str(tmp_path / "nonexistent.gguf")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode != 0 and "model path does not exist" in run.stderr
    assert "Traceback" not in run.stderr and "BrokenPipeError" not in run.stderr
