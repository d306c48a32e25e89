"""The ``openenv`` environment against a real OpenEnv server (OpenEnv's own ``create_app`` under uvicorn, no container).

The server's environment is written here: a higher/lower game whose secret comes from ``reset``'s
keyword arguments, so the tests can check by hand what each turn's observation and reward must be.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import warnings

import pytest

pytest.importorskip("openenv.core.env_server", reason="the openenv extra is not installed")

from openenv.core.env_server import create_app  # noqa: E402
from openenv.core.env_server.interfaces import Environment as OpenEnvEnvironment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

from rltk.errors import ConfigError  # noqa: E402
from rltk.rollout.base import SamplingParams  # noqa: E402
from rltk.workflows.multi_turn import MultiTurnWorkflow  # noqa: E402
from tests.builtin_plugins import ensure_registered  # noqa: E402
from tests.workflows.multi_turn_helpers import ScriptedEngine, tool_tokenizer  # noqa: E402
from tests.waits import scaled


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    text: str = ""
    guesses: int = 0


class HigherLower(OpenEnvEnvironment):
    """Answers "higher"/"lower"; reward 1 and done on the secret; "a number" to anything else."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    step_delay_s = 0.0  # the "hanging server" test raises it

    def __init__(self):
        super().__init__()
        self.secret, self.guesses = None, 0
        self._state = State(episode_id="", step_count=0)

    def reset(self, seed=None, episode_id=None, secret: int = 7, **kwargs):
        self.secret, self.guesses = int(secret), 0
        return GuessObservation(text=f"guess 1-9 (secret set {seed})", done=False, reward=None)

    def step(self, action, timeout_s=None, **kwargs):
        if HigherLower.step_delay_s:
            time.sleep(HigherLower.step_delay_s)
        self.guesses += 1
        self._state.step_count += 1
        try:
            guess = int(action.message.strip())
        except ValueError:
            return GuessObservation(text="a number", guesses=self.guesses, reward=0.0, done=False)
        if guess == self.secret:
            return GuessObservation(text="correct", guesses=self.guesses, reward=1.0, done=True,
                                    metadata={"guesses": self.guesses})
        return GuessObservation(text="higher" if guess < self.secret else "lower", guesses=self.guesses,
                                reward=0.0, done=False)

    @property
    def state(self):
        return self._state


class Server:
    """OpenEnv's app under uvicorn in a thread of this process, on a free port."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + scaled(30)
        while not self.server.started:
            assert time.monotonic() < deadline, f"the OpenEnv test server did not start within {scaled(30):.0f} s"
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(scaled(10))


@pytest.fixture(scope="module")
def server():
    ensure_registered("openenv_environment")
    srv = Server(create_app(HigherLower, GuessAction, GuessObservation, env_name="higher_lower",
                            max_concurrent_envs=16))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tok():
    return tool_tokenizer()


def workflow(tok, engine, url, n=1, **args):
    env = {"environment": "openenv", "max_turns": 4, "max_total_tokens": 256,
           "environment_args": {"url": url, "observation_field": "text", "reset_from_extras": ["secret"], **args}}
    return MultiTurnWorkflow(engine=engine, tokenizer=tok, reward=lambda **sample: 0.0,
                             sampling=SamplingParams(n=n, max_new_tokens=8), env=env)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_an_episode_is_played_on_the_server_token_in_token_out(tok, server):
    engine = ScriptedEngine(tok, ["5", "9", "7"])
    wf = workflow(tok, engine, server.url)
    (e,) = wf.run([{"prompt": "play", "ground_truth": "", "extras": {"secret": 7}, "id": "r0"}])
    # the opening: the row's message, then the reset observation as a user message
    assert e.prompt_ids == ids(tok, "<|user|>play<|eos|><|user|>guess 1-9 (secret set None)<|eos|><|assistant|>")
    eos = [tok.eos_token_id]
    higher, lower = ids(tok, "<|user|>higher<|eos|><|assistant|>"), ids(tok, "<|user|>lower<|eos|><|assistant|>")
    expected = ids(tok, "5") + eos + higher + ids(tok, "9") + eos + lower + ids(tok, "7") + eos
    assert e.response_ids == expected
    assert e.response_mask == [1, 1] + [0] * len(higher) + [1, 1] + [0] * len(lower) + [1, 1]
    assert e.rollout_logprobs == [-0.5, -0.5] + [0.0] * len(higher) + [-0.5, -0.5] + [0.0] * len(lower) + [-0.5] * 2
    last = [i for i, m in enumerate(e.response_mask) if m][1::2]  # each turn's eos
    assert e.turn_rewards == [(last[0], 0.0), (last[1], 0.0), (last[2], 1.0)]
    assert e.score == 1.0 and e.info["stop_reason"] == "done" and e.info["turns"] == 3
    assert e.info["env_info"] == [{"metadata": {"guesses": 3}}]


def test_each_episode_has_its_own_server_session(tok, server):
    """Four episodes open at once, two secrets: each session keeps its own secret and guess count."""
    engine = ScriptedEngine(tok, ["3", "6"])
    wf = workflow(tok, engine, server.url, n=2)
    rows = [{"prompt": "a", "ground_truth": "", "extras": {"secret": 3}, "id": "a"},
            {"prompt": "b", "ground_truth": "", "extras": {"secret": 6}, "id": "b"}]
    experiences = wf.run(rows)
    assert [e.score for e in experiences] == [1.0, 1.0, 1.0, 1.0]
    assert [e.info["turns"] for e in experiences] == [1, 1, 2, 2]
    assert [e.info["env_info"] for e in experiences] == [[{"metadata": {"guesses": 1}}]] * 2 + \
        [[{"metadata": {"guesses": 2}}]] * 2
    assert wf.metrics()["rollout/env_errors"] == 0.0


def test_observation_as_json_and_reset_args(tok, server):
    engine = ScriptedEngine(tok, ["x", "4"])
    wf = workflow(tok, engine, server.url, observation_field=None, opening="observation", reset_args={"seed": 5},
                  reset_from_extras=[])
    (e,) = wf.run([{"prompt": "ignored", "ground_truth": "", "extras": {}, "id": "r"}])
    messages = e.info["messages"]
    assert messages[0] == {"role": "user", "content": '{"guesses": 0, "text": "guess 1-9 (secret set 5)"}'}
    assert messages[2] == {"role": "user", "content": '{"guesses": 1, "text": "a number"}'}
    assert messages[4] == {"role": "user", "content": '{"guesses": 2, "text": "higher"}'}  # 4 < the default 7
    assert e.info["turns"] == 4 and e.info["stop_reason"] == "max_turns" and e.score == 0.0


@pytest.mark.parametrize("args, key", [
    ({"url": "localhost:1"}, "env.environment_args.url"),
    ({"opening": "both"}, "env.environment_args.opening"),
    ({"message_timeout_s": 0}, "env.environment_args.message_timeout_s"),
    ({"reset_from_extras": "secret"}, "env.environment_args.reset_from_extras"),
    ({"action_args": [1]}, "env.environment_args.action_args"),
])
def test_bad_arguments_name_the_key(tok, server, args, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        workflow(tok, ScriptedEngine(tok, ["1"]), args.pop("url", server.url), **args)


def test_a_server_that_is_down_stops_the_run_naming_the_url(tok):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"env\.environment_args\.url: no OpenEnv server answered GET "
                                          rf"http://127\.0\.0\.1:{port}/health within 0\.5 s"):
        workflow(tok, ScriptedEngine(tok, ["1"]), f"http://127.0.0.1:{port}", connect_timeout_s=0.5)


def test_a_hanging_step_times_out_naming_what_it_waited_for(tok, server):
    engine = ScriptedEngine(tok, ["5"])
    wf = workflow(tok, engine, server.url, message_timeout_s=0.3)
    HigherLower.step_delay_s = 1.0
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (e,) = wf.run([{"prompt": "p", "ground_truth": "", "extras": {"secret": 7}, "id": "r"}])
    finally:
        HigherLower.step_delay_s = 0.0
    assert wf.metrics()["rollout/env_errors"] == 1.0
    assert e.info["stop_reason"] == "env_error"
    assert f"the environment server at {server.url} did not answer step within 0.3 s " \
           "(env.environment_args.message_timeout_s)" in e.info["env_error"]
    assert any("did not answer step" in str(w.message) for w in caught)


# ------------------------------------------------------------------ from the command line

TINY = ["sft.steps=2", "sft.warmup_steps=0", "sft.stop_at_accuracy=null", "trainer.total_steps=2",
        "trainer.warmup_steps=0", "trainer.eval_every=0", "data.train_size=8", "data.eval_size=2",
        "trainer.prompts_per_step=2", "rollout.n=2", "checkpoint.resume=never", "checkpoint.every=0",
        "logging.logger=[jsonl]", "logging.plot=false", "rollout.workflow=multi_turn", "env.environment=openenv",
        "env.max_total_tokens=40", "rollout.max_new_tokens=4"]


def test_cli_exits_2_naming_the_key_for_a_bad_argument_and_a_server_that_is_down(tmp_path, capsys):
    from rltk.commands.cli import main

    assert main(["run", "grpo", f"output_dir={tmp_path / 'a'}", *TINY, "env.environment_args.url=http://x",
                 "env.environment_args.observation_fild=text"]) == 2
    assert "env.environment_args.observation_fild" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    assert main(["run", "grpo", f"output_dir={tmp_path / 'b'}", *TINY, f"env.environment_args.url={url}",
                 "env.environment_args.connect_timeout_s=0.5"]) == 2
    err = capsys.readouterr().err
    assert f"env.environment_args.url: no OpenEnv server answered GET {url}/health within 0.5 s" in err
    assert "Traceback" not in err


@pytest.mark.slow  # two warm-up steps and two GRPO steps of the tiny model against the server (~10 s)
def test_grpo_trains_on_an_openenv_server(tmp_path, server):
    import json

    from rltk.commands.cli import main

    run_dir = tmp_path / "run"
    assert main(["run", "grpo", f"output_dir={run_dir}", *TINY, f"env.environment_args.url={server.url}",
                 "env.environment_args.observation_field=text", "env.max_turns=2"]) == 0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl_lines = [m for m in lines if "rollout/turns_mean" in m]
    assert len(rl_lines) == 2
    for m in rl_lines:
        assert m["rollout/env_errors"] == 0.0 and 1.0 <= m["rollout/turns_mean"] <= 2.0
