"""Record llama-server's streamed and non-streamed ``/v1`` answers for the fold unit tests.

Writes ``openai_sse_recorded.json`` beside this file: for each case the request, the SSE
events of the streamed request exactly as the gateway sends it (``stream: true``,
``stream_options.include_usage``) and the worker's own non-streamed answer to the same body.
Made with the pinned llama-server (llama.cpp ``0c1e570``) on the demo model:

    llama-server -m ~/.cache/llama-gateway/models/demo.gguf --port 18731 -np 4 -c 8192 -t 1
    python tests/api/record_openai_sse.py http://127.0.0.1:18731

``cache_prompt: false`` keeps ``prompt_tokens_details.cached_tokens`` equal between the two.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

OUT = Path(__file__).with_name("openai_sse_recorded.json")
HI = [{"role": "user", "content": "hi"}]
BASE = {"temperature": 0, "seed": 7, "cache_prompt": False}

CASES = {
    "chat": ("/v1/chat/completions", {"messages": HI, "max_tokens": 8}),
    "chat_stop": ("/v1/chat/completions", {"messages": HI, "max_tokens": 60, "temperature": 1,
                                           "seed": 4, "stop": ["e"]}),
    "chat_n2_logprobs": ("/v1/chat/completions", {"messages": HI, "max_tokens": 3, "n": 2,
                                                  "logprobs": True, "top_logprobs": 2}),
    "completion": ("/v1/completions", {"prompt": "hello", "max_tokens": 8, "temperature": 1,
                                       "seed": 11}),
    "completion_stop": ("/v1/completions", {"prompt": "hi", "max_tokens": 60, "temperature": 1,
                                            "seed": 4, "stop": [" "]}),
    "completion_n2_logprobs": ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "n": 2,
                                                   "logprobs": 2}),
    "completion_two_prompts": ("/v1/completions", {"prompt": ["a", "b c"], "max_tokens": 4}),
}


def record(url: str) -> dict:
    out = {}
    with httpx.Client(base_url=url, timeout=60) as c:
        for name, (path, body) in CASES.items():
            body = {**BASE, **body}
            direct = c.post(path, json=body).json()
            events = []
            with c.stream("POST", path, json={**body, "stream": True,
                                              "stream_options": {"include_usage": True}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
            out[name] = {"path": path, "request": body, "events": events, "non_streamed": direct}
    return out


if __name__ == "__main__":
    OUT.write_text(json.dumps(record(sys.argv[1]), indent=1, ensure_ascii=False) + "\n")
