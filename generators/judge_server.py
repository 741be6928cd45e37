"""The reward worker: a judge model served over HTTP for the `judge` reward (envs/judge.py).

`rollctl start-reward-worker --config run.yaml [--host H] [--port P]` loads
`reward.judge.model_path` with transformers on `rollout.device` and answers `POST
/v1/completions` (the OpenAI-style subset the judge client sends: `prompt` a string or a list,
`max_tokens`, `temperature`; 0 is greedy) with `{"choices": [{"index": i, "text": ...}]}`, the
text after each prompt up to its EOS. `GET /health` answers 200 once the model is loaded.

One process, one model: requests from any number of generators are answered one batch at a time
(a lock around `generate`), each batch as one left-padded forward pass. It holds no run state:
it can be restarted at any time, and a generator whose request fails scores that batch 0 with the
counted reason `judge_unreachable`. For a large judge, `vllm serve` speaks the same API with
continuous batching; point `reward.judge.url` at it instead.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from rollflash.broker.config.generation import neutral_generation_config
from rollflash.errors import MissingFile

log = logging.getLogger(__name__)

MAX_BODY = 16 << 20  # bytes of one request
MAX_PROMPTS = 4096  # prompts of one request


class JudgeModel:
    """A causal LM that completes prompts, greedily or at a temperature."""

    def __init__(self, path: str | Path, device: str | torch.device = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not (Path(path) / "config.json").is_file():
            raise MissingFile(f"reward.judge.model_path: no Hugging Face model at {path}")
        # transformers' stubs type `.to` and `decode` more narrowly than they behave
        self.tokenizer: Any = AutoTokenizer.from_pretrained(path)
        model: Any = AutoModelForCausalLM.from_pretrained(path)
        self.model = model.to(device).eval()
        self.device = device
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        neutral_generation_config(
            model,
            self.tokenizer.eos_token_id,
            self.pad_id,
            f"judge: {path}",
            "it completes greedily or at the request's temperature",
            log,
        )
        self.lock = threading.Lock()

    @torch.no_grad()
    def complete(self, prompts: list[str], max_tokens: int, temperature: float) -> list[str]:
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
        enc = {k: v.to(self.device) for k, v in enc.items()}
        sampling: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0}
        with self.lock:
            out = self.model.generate(
                **enc,
                max_new_tokens=max_tokens,
                pad_token_id=self.pad_id,
                eos_token_id=self.tokenizer.eos_token_id,
                **sampling,
            )
        texts: list[str] = []
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            if self.tokenizer.eos_token_id in row:
                row = row[: row.index(self.tokenizer.eos_token_id)]
            texts.append(self.tokenizer.decode(row, skip_special_tokens=True))
        return texts


def _request(body: bytes) -> tuple[list[str], int, float]:
    """(prompts, max_tokens, temperature) of a completions request; ValueError if malformed."""
    data = json.loads(body)
    prompts = data.get("prompt")
    prompts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompt: a string or a list of strings")
    if not 0 < len(prompts) <= MAX_PROMPTS:
        raise ValueError(f"prompt: 1 to {MAX_PROMPTS} prompts")
    max_tokens, temperature = data.get("max_tokens", 16), data.get("temperature", 0.0)
    if not isinstance(max_tokens, int) or not 0 < max_tokens <= 4096:
        raise ValueError("max_tokens: an integer in [1, 4096]")
    if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 10:
        raise ValueError("temperature: a number in [0, 10]")
    return prompts, max_tokens, float(temperature)


def make_server(
    judge: JudgeModel, host: str = "127.0.0.1", port: int = 8100
) -> ThreadingHTTPServer:
    """The HTTP server (not yet serving: call `serve_forever`); port 0 picks a free one."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/health":
                self._reply(200, {"status": "ok"})
            else:
                self._reply(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/v1/completions":
                return self._reply(404, {"error": "not found"})
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY:
                return self._reply(413, {"error": f"body of 1 to {MAX_BODY} bytes"})
            try:
                prompts, max_tokens, temperature = _request(self.rfile.read(length))
            except ValueError as e:
                return self._reply(400, {"error": str(e)})
            texts = judge.complete(prompts, max_tokens, temperature)
            choices = [
                {"index": i, "text": t, "finish_reason": "stop"} for i, t in enumerate(texts)
            ]
            self._reply(200, {"object": "text_completion", "choices": choices})

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("judge: " + format, *args)

    return ThreadingHTTPServer((host, port), Handler)


def serve(cfg: Any, host: str, port: int) -> None:
    """`rollctl start-reward-worker`: load the judge and answer until interrupted."""
    from rollflash.generators.device import resolve_device

    path = cfg.reward.judge.model_path
    if not path:
        raise MissingFile("reward.judge.model_path: set the judge model to serve")
    judge = JudgeModel(path, resolve_device(cfg.rollout.device))
    server = make_server(judge, host, port)
    log.info("reward worker: judge %s at http://%s:%d", path, *server.server_address[:2])
    try:
        server.serve_forever()
    finally:
        server.server_close()
