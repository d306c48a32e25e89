"""``llm_judge``: the rubric reaches a real rltk endpoint as rendered, the verdict in its reply is parsed, and a judge
that is down or hangs costs a bounded time and a counted fallback."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from rltk.commands.cli import main
from rltk.rewards.compose import build_reward_composer
from rltk.rewards.judges.llm_judge import UnparsedVerdict, llm_judge, parse_verdict
from rltk.rollout.base import SamplingParams
from rltk.serve.app import BackgroundServer, create_app
from rltk.serve.sessions import SessionStore
from tests.rewards.slow_http import SlowServer, chat_completion, timed
from tests.serve.helpers import ScriptedEngine

from tests.waits import scaled

TEMPLATE = "Q: {prompt} | ref: {ground_truth} | A: {response} | grade?"


def test_parse_verdict_by_hand():
    assert parse_verdict("looks right. Score: 7") == pytest.approx(0.7)
    assert parse_verdict("Score: 2 at first, on reflection score = 9.5") == pytest.approx(0.95)  # the last one
    assert parse_verdict("SCORE: 3", max_score=5) == pytest.approx(0.6)
    assert parse_verdict("Yes, it is. Final: no", parser="yes_no") == 0.0
    assert parse_verdict("I'd say yes", parser="yes_no") == 1.0
    assert parse_verdict("verdict=[4/5]", pattern=r"\[(\d)/5\]", max_score=5) == pytest.approx(0.8)
    with pytest.raises(UnparsedVerdict, match="no verdict matching"):
        parse_verdict("I cannot tell")
    with pytest.raises(UnparsedVerdict):
        parse_verdict("yesterday, nothing", parser="yes_no")


def scripted_judge(prompt_text: str) -> str:
    """A judge whose verdicts we know: reads the rendered rubric the server received and grades by it."""
    answer = prompt_text.split("| A: ")[1].split(" | grade?")[0]
    reference = prompt_text.split("| ref: ")[1].split(" | A: ")[0]
    if answer == "???":
        return "I cannot grade this."
    return "Matches the reference. Score: 10" if answer == reference else "Wrong. Score: 3"


@pytest.fixture
def judge_server():
    """A real rltk OpenAI-compatible endpoint (uvicorn + the app) whose engine answers by :func:`scripted_judge`,
    recording every session."""
    from rltk.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    engine = ScriptedEngine(tokenizer, scripted_judge)
    app = create_app(engine, tokenizer, model_name="judge", defaults=SamplingParams(max_new_tokens=64),
                     max_model_len=None, store=SessionStore())
    with BackgroundServer(app) as server:
        yield server.base_url, engine, tokenizer


def test_the_rendered_rubric_reaches_the_endpoint_and_its_verdicts_combine_with_exact_match(judge_server):
    url, engine, tokenizer = judge_server
    samples = [{"prompt": "1+2=", "response": "3", "ground_truth": "3"},
               {"prompt": "4+4=", "response": "9", "ground_truth": "8"},
               {"prompt": "5+5=", "response": "???", "ground_truth": "10"}]
    composer = build_reward_composer(
        ["exact_match", "llm_judge"], weights={"exact_match": 1.0, "llm_judge": 0.5},
        args={"llm_judge": {"url": url, "model": "judge", "template": TEMPLATE, "max_tokens": 40,
                            "system": "You grade."}}, fallback=-1.0)
    with pytest.warns(RuntimeWarning, match="reward 'llm_judge' failed on a sample \\(UnparsedVerdict: no verdict"):
        results = composer.score_batch(samples)
    assert [d["llm_judge"] for _, d in results] == pytest.approx([1.0, 0.3, -1.0])
    assert [total for total, _ in results] == pytest.approx([1.0 + 0.5, 0.0 + 0.15, 0.0 - 0.5])
    stats = composer.stats()
    assert stats["failures/llm_judge"] == 1 and stats["timeouts/llm_judge"] == 0
    # what the endpoint's engine got: the chat template over the system line and the filled rubric, exactly
    sent = sorted(tokenizer.decode(ids) for call_prompts, _ in engine.calls for ids in call_prompts)
    expected = sorted(tokenizer.apply_chat_template(
        [{"role": "system", "content": "You grade."},
         {"role": "user", "content": TEMPLATE.format(prompt=s["prompt"], response=s["response"],
                                                     ground_truth=s["ground_truth"])}],
        tokenize=False, add_generation_prompt=True) for s in samples)
    assert sent == expected
    assert all(params.greedy or params.temperature == 0 for _, params in engine.calls)
    assert all(params.max_new_tokens == 40 for _, params in engine.calls)


def closed_port() -> int:
    with socket.socket() as sock:  # bound, then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_judge_that_is_down_is_a_counted_fallback_within_the_backoff():
    composer = build_reward_composer(
        ["llm_judge"], args={"llm_judge": {"url": f"http://127.0.0.1:{closed_port()}/v1", "model": "m",
                                           "retries": 2, "backoff_s": 0.1}}, fallback=0.25)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="ConnectionError: cannot reach"):
        results = composer.score_batch([{"prompt": "p", "response": "r", "ground_truth": "g"}] * 64)
    # refused at once; 0.1 + 0.2 s of backoff for the first round of 8, and the other 56 are not sent
    # (sent, they would cost 8 rounds: 2.4 s)
    assert time.monotonic() - start < scaled(1.2)
    assert [score for score, _ in results] == [0.25] * 64
    assert composer.stats()["failures/llm_judge"] == 64 and composer.stats()["timeouts/llm_judge"] == 0


def test_a_judge_that_hangs_times_out_each_try_and_the_step_waits_a_bounded_time():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held, stop = [], threading.Event()

    def accept_and_never_answer():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept_and_never_answer, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
        start = time.monotonic()
        out = llm_judge(prompt=["p"] * 40, response=["r"] * 40, ground_truth=["g"] * 40, url=url, model="m",
                        timeout_s=0.5, retries=1, backoff_s=0.05, concurrency=4)
        elapsed = time.monotonic() - start
        # the first four requests in parallel: two tries of 0.5 s and one backoff, ~1.05 s; the other 36 not sent
        assert 1.0 <= elapsed < scaled(2.5), elapsed
        assert all(isinstance(o, TimeoutError) for o in out[:4]), out
        assert all(isinstance(o, ConnectionError) and "not sent" in str(o) for o in out[4:]), out
        assert len(held) == 8  # every try connected and was accepted; nothing else was sent
        composer = build_reward_composer(["llm_judge"], args={"llm_judge": {"url": url, "model": "m", "timeout_s": 0.3,
                                                                          "retries": 0}})
        with pytest.warns(RuntimeWarning, match="TimeoutError: .* did not answer within 0.3 s"):
            composer.score_batch([{"prompt": "p", "response": "r", "ground_truth": "g"}] * 2)
        assert composer.stats()["timeouts/llm_judge"] == 2 and composer.stats()["failures/llm_judge"] == 2
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()


@pytest.mark.parametrize("headers_too", [False, True], ids=["body", "status-headers-and-body"])
def test_a_judge_that_trickles_its_answer_times_out_each_try_at_timeout_s_and_is_not_scored(headers_too):
    # A byte every 0.2 s meets any socket timeout over 0.2 s: before, each try lasted as long as the answer
    # (70 bytes of body: 14 s) and the verdict "Score: 10" was scored 1.0. The deadline holds each try to
    # timeout_s, connecting, sending and reading the whole answer together.
    with SlowServer(chat_completion("Score: 10"), byte_every_s=0.2, headers_too=headers_too) as server:
        composer = build_reward_composer(["llm_judge"], args={"llm_judge": {
            "url": server.url + "/v1", "model": "m", "timeout_s": 1, "retries": 1, "backoff_s": 0.1}}, fallback=-1.0)
        with pytest.warns(RuntimeWarning, match="TimeoutError: .* did not answer within 1 s"):
            results, elapsed = timed(lambda: composer.score_batch([{"prompt": "p", "response": "r",
                                                                    "ground_truth": "g"}]))
        # (retries + 1) * timeout_s + backoff = 2 * 1 + 0.1 s
        assert 2.1 <= elapsed < scaled(2.1 + 1.0), elapsed
        assert server.accepted == 2  # the try and its retry, each cut off at its deadline
    assert [score for score, _ in results] == [-1.0]
    assert composer.stats()["failures/llm_judge"] == 1 and composer.stats()["timeouts/llm_judge"] == 1


def test_config_errors_name_the_key_and_what_is_valid(capsys):
    base = ["validate", "grpo", "reward.reward_fn=[exact_match,llm_judge]",
            "reward.reward_fn_args.llm_judge.url=http://judge:8000/v1"]
    assert main(base) == 2
    assert "'reward.reward_fn_args.llm_judge': reward_fn 'llm_judge' needs argument(s) model" in capsys.readouterr().err
    base.append("reward.reward_fn_args.llm_judge.model=qwen")
    assert main([*base, "reward.reward_fn_args.llm_judge.template='{prompt} {answer} {response}'"]) == 2
    err = capsys.readouterr().err
    assert "'reward.reward_fn_args.llm_judge': reward_fn 'llm_judge': template has field(s) ['{answer}']" in err
    assert "valid fields: {prompt}, {response}, {ground_truth}" in err and "Traceback" not in err
    assert main([*base, "reward.reward_fn_args.llm_judge.parser=stars"]) == 2
    assert "parser must be one of number, yes_no, got 'stars'" in capsys.readouterr().err
    assert main([*base, "reward.reward_fn_args.llm_judge.pattern='score'"]) == 2
    assert "needs a capturing group" in capsys.readouterr().err
    assert main(base) == 0


@pytest.mark.slow  # an `rltk serve` process on the embedded tiny model (~10-20 s)
def test_a_real_rltk_serve_judge_is_greedy_and_its_reply_is_parsed_as_returned(tmp_path):
    """The untrained tiny model behind `rltk serve`: whatever it says, the judge's score is the parser's reading of
    the exact reply the endpoint returns for the rendered rubric (a score, or the counted fallback), every time.

    (Greedy, this model says nothing at all here, eos first: the fallback path. The parsed path on text an
    endpoint returned is the scripted-engine test above, through the same app.)"""
    import openai

    from rltk.models.tiny import save_pretrained_dir
    from tests.serve.helpers import tiny_chat_model
    from tests.serve.test_cli_serve import start_serving, stop

    tokenizer, model = tiny_chat_model()
    proc, url = start_serving(save_pretrained_dir(model, tokenizer, tmp_path / "judge"), "--max-tokens", "24")
    try:
        samples = {"prompt": ["12+3="] * 2 + ["7+1="], "response": ["15", "15", "9"], "ground_truth": ["15"] * 2 + ["8"]}
        template = "{prompt}{response} ok?"
        args = dict(url=url, model="judge", template=template, max_tokens=24, parser="number", pattern=r"(\d)",
                    max_score=9)
        first = llm_judge(**samples, **args)
        again = llm_judge(**samples, **args)
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        for i, (a, b) in enumerate(zip(first, again)):
            reply = client.chat.completions.create(
                model="judge", temperature=0, max_tokens=24,
                messages=[{"role": "user", "content": template.format(prompt=samples["prompt"][i],
                                                                      response=samples["response"][i])}],
            ).choices[0].message.content
            try:
                expected = parse_verdict(reply, "number", r"(\d)", 9)
            except UnparsedVerdict:
                assert isinstance(a, UnparsedVerdict) and isinstance(b, UnparsedVerdict) and str(a) == str(b)
            else:
                assert a == b == expected
        assert first[0] == first[1] or str(first[0]) == str(first[1])  # same rubric, same greedy verdict
    finally:
        stop(proc)


def test_a_judge_answering_503_is_retried_with_backoff_until_it_answers():
    """Two 503s (a server shedding load), then a chat completion: the third try's verdict is the score."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    arrivals: list[float] = []

    class Flaky(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            arrivals.append(time.monotonic())
            status, body = (503, {"error": "busy"}) if len(arrivals) <= 2 else (
                200, {"choices": [{"message": {"role": "assistant", "content": "Fine. Score: 8"}}]})
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        assert llm_judge(prompt=["p"], response=["r"], ground_truth=["g"], url=url, model="m", retries=2,
                         backoff_s=0.1) == [pytest.approx(0.8)]
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        assert len(arrivals) == 3 and gaps[0] >= 0.1 and gaps[1] >= 0.2  # backoff 0.1 s, then twice that
        arrivals.clear()
        [out] = llm_judge(prompt=["p"], response=["r"], ground_truth=["g"], url=url, model="m", retries=1,
                          backoff_s=0.01)
        assert isinstance(out, ValueError) and "HTTP 503" in str(out)  # tries spent: the error, for the fallback
    finally:
        server.shutdown()
        server.server_close()
