"""The bundled SmolLM2-135M-Instruct, end to end: offline API and CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conveyor import LLM, SamplingParams
from conveyor.model.checkpoint import default_model_path

pytest.importorskip("gguf")
try:
    default_model_path()
except Exception as exc:  # noqa: BLE001 - skip cleanly when the model package is absent
    pytest.skip(f"default model not installed: {exc}", allow_module_level=True)


# Asked plainly, this 135M model's first token is a near tie ("The" vs "L'"), which the KV cache's
# rounding decides (llama.cpp answers "L'Étoile, ..." in float16 and float32 alike); asked this way
# the answer is clear of it.
ASK = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(threads=2)


def test_greedy_chat_answer_names_paris(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": ASK}],
                   SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"            # ended at <|im_end|>, not the length limit
    assert out.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert "<|im_end|>" not in out.text


def test_outputs_in_input_order_with_timings(llm: LLM) -> None:
    prompts = ["One, two, three,", [1, 9690, 198], "The alphabet starts with"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [o.prompt for o in outs] == prompts
    assert outs[1].prompt_token_ids == [1, 9690, 198]
    for out in outs:
        assert len(out.token_ids) == 5 and out.finish_reason == "length"
        m = out.metrics
        assert m.arrival_s <= m.first_scheduled_s <= m.first_token_s <= m.finished_s
        assert m.num_output_tokens == 5


def test_stop_string_is_not_returned(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=32)
    full = llm.chat([{"role": "user", "content": ASK}], params)[0].text
    assert "Paris" in full
    stopped = llm.chat([{"role": "user", "content": ASK}],
                       SamplingParams(temperature=0, max_tokens=32, stop=["Paris"]))[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Paris"
    assert stopped.text == full[: full.index("Paris")]


def test_unknown_option_and_bad_value() -> None:
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(max_num_seqs=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conveyor", *args], capture_output=True, text=True, timeout=300)


def test_cli_generate_streams_the_answer() -> None:
    result = _cli("generate", ASK, "--max-tokens", "32", "--threads", "2")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.parametrize("make_model", ["missing", "not_a_model", "unsupported"])
def test_cli_errors_are_clear_without_traceback(tmp_path, make_model: str) -> None:
    if make_model == "missing":
        model, expect = tmp_path / "nope.gguf", "does not exist"
    elif make_model == "not_a_model":
        model = tmp_path / "notes.txt"
        model.write_text("hello")
        expect = "not a GGUF file"
    else:
        model = tmp_path / "gpt2"
        model.mkdir()
        (model / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
        expect = "unsupported architecture 'GPT2LMHeadModel'"
    result = _cli("generate", "hi", "--model", str(model))
    assert result.returncode != 0
    assert expect in result.stderr
    assert "Traceback" not in result.stderr


def test_readme_offline_example_prints_the_chat_answer(llm: LLM, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The README's offline example, run as written (on this module's engine), prints what it says."""
    import re
    from pathlib import Path

    import conveyor

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = re.search(r"Offline Python API.*?```python\n(.*?)```", readme, re.S).group(1)
    monkeypatch.setattr(conveyor, "LLM", lambda **options: llm)
    exec(compile(example, "README.md", "exec"), {})
    printed = capsys.readouterr().out.strip().splitlines()
    promised = re.search(r"print\(chat\[0\]\.text\)\s*# (.*)", example).group(1)
    assert printed[-1] == promised == "The capital of France is Paris."
