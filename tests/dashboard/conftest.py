"""A real dashboard server on a free port of 127.0.0.1, in a thread of the test process."""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path

import pytest

from rltk.dashboard.server import Dashboard

from tests.waits import scaled


class Client:
    """Requests to the dashboard as the page makes them (its token on POSTs)."""

    def __init__(self, server: Dashboard):
        self.server = server
        self.host, self.port = server.server_address[:2]

    def request(self, method: str, path: str, body=None, headers=None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=scaled(60))
        data = json.dumps(body).encode() if body is not None else None
        hdrs = {"Content-Type": "application/json"} if data is not None else {}
        if method == "POST":
            hdrs["X-Rltk-Token"] = self.server.token
        hdrs.update(headers or {})
        conn.request(method, path, body=data, headers=hdrs)
        response = conn.getresponse()
        payload = response.read()
        conn.close()
        kind = response.getheader("Content-Type", "")
        return response.status, (json.loads(payload) if kind.startswith("application/json") else payload)

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def post(self, path, body, **kw):
        return self.request("POST", path, body, **kw)


@pytest.fixture
def dashboard(tmp_path):
    """``(client, runs folder, save folder)`` of a dashboard serving until the test ends."""
    runs_root, save_dir = tmp_path / "runs", tmp_path / "configs"
    runs_root.mkdir()
    save_dir.mkdir()
    server = Dashboard("127.0.0.1", 0, runs_root, save_dir)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Client(server), runs_root, save_dir
    server.shutdown()
    server.server_close()
    thread.join(timeout=scaled(10))


def write_run(folder: Path, reward_offset: float = 0.0) -> Path:
    """A small run folder as a run writes it: metrics.jsonl, traces.jsonl (two steps), summary, config.

    The rewards are 0.5 and 0.75 (steps 3, 4) plus ``reward_offset``, so two runs can differ."""
    folder.mkdir(parents=True)
    rows = [{"step": 1, "sft/sft_loss": 2.0}, {"step": 2, "sft/sft_loss": 1.5},
            {"step": 2, "eval/accuracy": 0.25, "eval/sampled_accuracy": 0.125},
            {"step": 3, "reward": 0.5 + reward_offset, "kl": 0.01},
            {"step": 4, "reward": 0.75 + reward_offset, "kl": 0.02, "eval/accuracy": 0.5,
             "eval/sampled_accuracy": 0.375}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    traces = []
    for step in (3, 4):
        for sample, (score, response) in enumerate([(1.0, "42"), (0.0, "41")]):
            traces.append({"step": step, "stage": "grpo", "stage_step": step - 2, "row": sample, "group_id": 0,
                           "sample_index": sample, "row_id": "r7", "prompt": "40+2=", "response": response,
                           "ground_truth": "42", "score": score, "rewards": {"exact_match": score},
                           "advantage": 0.7071 if score else -0.7071, "finish_reason": "stop", "source": "policy",
                           "staleness": 0, "response_tokens": 3, "policy_tokens": 2,
                           "tokens": [response[0], "<obs>", response[1]], "token_ids": [1, 2, 3],
                           "response_mask": [1, 0, 1], "advantages": [0.7071 if score else -0.7071, 0.0,
                                                                      0.7071 if score else -0.7071],
                           "logprobs": [-0.5, 0.0, -0.25], "token_rewards": [0.0, 0.0, score], "values": None,
                           "info": {"messages": [{"role": "assistant", "content": response[0]},
                                                 {"role": "tool", "content": "<obs>"},
                                                 {"role": "assistant", "content": response[1]}],
                                    "tool_calls": 1}})
    (folder / "traces.jsonl").write_text("".join(json.dumps(t) + "\n" for t in traces))
    (folder / "summary.json").write_text(json.dumps({"final": {"eval/accuracy": 0.5}, "steps": 4}))
    (folder / "config.yaml").write_text("name: demo\n")
    return folder
