"""`conveyor run-batch` on the tiny model: OpenAI batch lines in, one result line each out, a bad
line gets its own error line while the rest runs, and a rerun resumes (a torn last line from a
killed run included) without running anything twice."""

from __future__ import annotations

import json
from pathlib import Path

from conveyor.cli import main

GOOD = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}},
    {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "the sky is", "max_tokens": 3, "temperature": 0, "ignore_eos": True}},
    {"custom_id": "regex", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "code:", "max_tokens": 8, "temperature": 0, "guided_regex": "[a-c]{3}"}},
]
BAD = [
    "{not json",
    json.dumps({"custom_id": "range", "url": "/v1/completions", "body": {"prompt": "x", "temperature": -1}}),
    json.dumps({"custom_id": "url", "url": "/v1/embeddings", "body": {"input": "x"}}),
    json.dumps({"custom_id": "stream", "url": "/v1/completions", "body": {"prompt": "x", "stream": True}}),
]


def run(tiny_checkpoint: Path, input_path: Path, output_path: Path, *flags: str) -> int:
    return main(["run-batch", "-i", str(input_path), "-o", str(output_path), "--model", str(tiny_checkpoint),
                 "--threads", "1", "--kv-cache-memory", "64MiB", *flags])


def results(path: Path) -> dict[str, dict]:
    lines = [json.loads(text) for text in path.read_text().splitlines() if text.strip()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a request was answered twice"
    return by_id


def test_every_line_gets_one_result_and_bad_lines_their_error(tiny_checkpoint: Path, tmp_path: Path) -> None:
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    input_path.write_text("\n".join([json.dumps(GOOD[0]), *BAD, *map(json.dumps, GOOD[1:])]) + "\n")
    assert run(tiny_checkpoint, input_path, output_path) == 1   # some lines failed
    out = results(output_path)
    assert set(out) == {"chat", "cmpl", "regex", "line-2", "range", "url", "stream"}
    for custom_id in ("chat", "cmpl", "regex"):
        assert out[custom_id]["error"] is None and out[custom_id]["response"]["status_code"] == 200
    assert out["chat"]["response"]["body"]["object"] == "chat.completion"
    assert out["cmpl"]["response"]["body"]["usage"]["completion_tokens"] == 3
    text = out["regex"]["response"]["body"]["choices"][0]["text"]
    assert len(text) == 3 and set(text) <= set("abc")
    assert out["range"]["response"]["status_code"] == 400 and "temperature" in out["range"]["error"]["message"]
    for custom_id in ("line-2", "url", "stream"):
        assert out[custom_id]["response"] is None and out[custom_id]["error"]["message"]


def test_a_rerun_resumes_after_a_killed_run(tiny_checkpoint: Path, tmp_path: Path) -> None:
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    input_path.write_text("".join(json.dumps(line) + "\n" for line in GOOD))
    # A run killed after answering "chat", in the middle of writing "cmpl".
    done = {"id": "batch_req_x", "custom_id": "chat", "response": {"status_code": 200, "request_id": "r",
                                                                 "body": {"kept": True}}, "error": None}
    output_path.write_text(json.dumps(done) + "\n" + '{"id": "batch_req_y", "custom_id": "cm')
    assert run(tiny_checkpoint, input_path, output_path) == 0
    assert output_path.read_text().split("\n")[0] == json.dumps(done)   # kept, not run again
    out = results(output_path)   # every line parses: the torn one was cut off
    assert set(out) == {"chat", "cmpl", "regex"} and out["chat"] == done
    assert run(tiny_checkpoint, input_path, output_path) == 0   # nothing left: nothing runs
    assert results(output_path) == out


def test_served_model_name_lets_a_file_written_for_another_model_run(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """OpenAI batch files name their model in every body; --served-model-name answers to that name."""
    input_path, output_path = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{**line, "body": {**line["body"], "model": "gpt-4o-mini"}} for line in GOOD[:2]]
    input_path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert run(tiny_checkpoint, input_path, output_path) == 1
    assert all(line["response"]["status_code"] == 404 for line in results(output_path).values())
    output_path.unlink()
    assert run(tiny_checkpoint, input_path, output_path, "--served-model-name", "gpt-4o-mini") == 0
    out = results(output_path)
    assert set(out) == {"chat", "cmpl"}
    assert all(line["response"]["body"]["model"] == "gpt-4o-mini" for line in out.values())
