"""Reward sources: rule functions and a remote reward service over real HTTP.

The remote service is a real HTTP server on 127.0.0.1 whose behaviour each
test scripts (fail N times, hang, answer garbage), so the client's timeout,
retry and error paths run against real sockets.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from alignflow.errors import ConfigError
from engines.rl.rewards import RemoteReward, RewardServiceError, RuleReward, ScoredText

ITEMS = [ScoredText("p1", "7", "7"), ScoredText("p2", "3", "9")]


class ScriptedService:
    """An HTTP reward service: `script` is a list of behaviours, one per request."""

    def __init__(self, script: list[str]):
        self.script = list(script)
        self.requests: list[dict] = []
        self.seen: list[dict] = []  # each request's path and Authorization header
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests.append(body)
                service.seen.append({"path": self.path, "authorization": self.headers.get("Authorization")})
                action = service.script.pop(0) if service.script else "ok"
                if action == "hang":
                    time.sleep(2.0)
                    action = "ok"
                if action.startswith("http"):
                    self.send_response(int(action[4:]))
                    self.end_headers()
                    return
                payload = (b"not json" if action == "garbage" else
                           json.dumps({"rewards": [1.0] * (len(body["responses"]) - (action == "short"))}).encode())
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(payload)
                except BrokenPipeError:
                    pass  # the client timed out first, as the timeout test intends

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service(request):
    svc = ScriptedService(request.param)
    yield svc
    svc.close()


@pytest.mark.parametrize("service", [["ok"]], indirect=True)
def test_remote_reward_sends_texts_and_returns_rewards(service):
    rewards = RemoteReward(service.url, timeout_s=5, max_retries=0)(ITEMS)
    assert rewards == [1.0, 1.0]
    assert service.requests == [{"prompts": ["p1", "p2"], "responses": ["7", "3"], "answers": ["7", "9"]}]


@pytest.mark.parametrize("service", [["http500", "http503", "ok"]], indirect=True)
def test_remote_reward_retries_server_errors(service):
    assert RemoteReward(service.url, timeout_s=5, max_retries=2, backoff_s=0.01)(ITEMS) == [1.0, 1.0]
    assert len(service.requests) == 3


@pytest.mark.parametrize("service", [["http500"] * 5], indirect=True)
def test_remote_reward_gives_up_after_bounded_retries(service):
    with pytest.raises(RewardServiceError) as err:
        RemoteReward(service.url, timeout_s=5, max_retries=2, backoff_s=0.01)(ITEMS)
    assert len(service.requests) == 3
    assert service.url in str(err.value) and "3 attempts" in str(err.value)


@pytest.mark.parametrize("service", [["http400"]], indirect=True)
def test_remote_reward_does_not_retry_client_errors(service):
    with pytest.raises(RewardServiceError, match="HTTP 400"):
        RemoteReward(service.url, timeout_s=5, max_retries=3, backoff_s=0.01)(ITEMS)
    assert len(service.requests) == 1


@pytest.mark.parametrize("service", [["hang", "hang"]], indirect=True)
def test_remote_reward_times_out(service):
    t0 = time.monotonic()
    with pytest.raises(RewardServiceError, match="timeout 0.3s"):
        RemoteReward(service.url, timeout_s=0.3, max_retries=1, backoff_s=0.01)(ITEMS)
    assert time.monotonic() - t0 < 1.9  # did not wait for the hanging handler


@pytest.mark.parametrize("service", [["garbage"], ["short"]], indirect=True)
def test_remote_reward_rejects_malformed_answers(service):
    with pytest.raises(RewardServiceError, match=service.url):
        RemoteReward(service.url, timeout_s=5, max_retries=0)(ITEMS)


def test_remote_reward_service_down():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens here
    url = f"http://127.0.0.1:{port}/score"
    with pytest.raises(RewardServiceError) as err:
        RemoteReward(url, timeout_s=1, max_retries=1, backoff_s=0.01)(ITEMS)
    assert url in str(err.value) and "2 attempts" in str(err.value)


@pytest.mark.parametrize("service", [["http400"], ["http500"], ["garbage"]], indirect=True)
def test_remote_reward_errors_name_the_service_without_its_credentials(service):
    # urllib sends no `user:pass@`, so a service's key travels in the query: the error names the rest.
    url = service.url.replace("http://", "http://bob:hunter2@") + "?api_key=s3cr3t&model=rm-v2"
    with pytest.raises(RewardServiceError) as err:
        RemoteReward(url, timeout_s=5, max_retries=0)(ITEMS)
    text = str(err.value)
    assert "s3cr3t" not in text and "hunter2" not in text
    assert f"{service.url}?api_key=***&model=rm-v2" in text


@pytest.mark.parametrize("service", [["ok"]], indirect=True)
def test_a_reward_url_takes_its_credentials_from_the_environment_where_it_is_called(service, monkeypatch):
    """`${NAME}`s are filled in from the environment of the process that calls the service, and a
    `user:password@` goes as basic auth; a name the environment lacks is a ConfigError naming the field."""
    import base64

    monkeypatch.setenv("RM_USER", "bob")
    monkeypatch.setenv("RM_PASSWORD", "hun@ter/2#")  # characters that would end the userinfo, or the URL
    monkeypatch.setenv("RM_API_KEY", "s3cr&t+x y")  # and the query parameter
    url = service.url.replace("http://", "http://${RM_USER}:${RM_PASSWORD}@") + "?api_key=${RM_API_KEY}&model=rm-v2"
    reward = RemoteReward(url, timeout_s=5, max_retries=0)
    assert reward(ITEMS) == [1.0, 1.0]
    assert service.seen == [{"path": "/score?api_key=s3cr%26t%2Bx+y&model=rm-v2",
                             "authorization": "Basic " + base64.b64encode(b"bob:hun@ter/2#").decode()}]
    assert "hun@ter" not in reward.name and "s3cr" not in reward.name
    monkeypatch.delenv("RM_API_KEY")
    with pytest.raises(ConfigError, match=r"rounds.0.reward.url: .* names RM_API_KEY, which the environment"):
        RemoteReward(url, timeout_s=5, max_retries=0, field="rounds.0.reward.url")


def test_rule_reward_by_import_path():
    rule = RuleReward("alignflow.data.synthetic:rule_reward")
    assert rule(ITEMS) == [1.0, 0.0]
    with pytest.raises(ValueError, match="reward.rule"):
        RuleReward("alignflow.data.synthetic:no_such_function")
    with pytest.raises(ValueError, match="module:function"):
        RuleReward("no_colon_here")


def test_rules_read_the_records_prompt_not_the_decoded_chat_template():
    # The round's rollouts carry the rendered template's token ids; a rule (and the judge, which the judge stage
    # calibrates on the records' prompts) reads the record's prompt instead: messages one per line.
    from engines.rl.round import scored_texts
    from engines.rollout.base import Rollout

    records = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}],
                "answer": "5"},
               {"prompt": "Largest digit of 192?", "answer": None}]
    rollouts = [Rollout(prompt_index=i, prompt_ids=[7, 8, 9], token_ids=[1], text=t, logprobs=[0.0], finished=True)
                for i, t in ((1, "9"), (0, "5"), (0, "6"))]
    assert scored_texts(rollouts, records) == [
        ScoredText("Largest digit of 192?", "9", None),
        ScoredText("Be brief.\nWhat is 2+3?", "5", "5"),
        ScoredText("Be brief.\nWhat is 2+3?", "6", "5"),
    ]


# ---- a process reward model over a response's steps (reward.source process_model) --------------------------


def test_a_response_splits_into_steps_each_ending_with_the_separator():
    from engines.steps import response_steps

    assert response_steps("3\n7\n9", "\n") == ["3\n", "7\n", "9\n"]  # the last step gets its separator too
    assert response_steps("\n3\n\n7\n", "\n") == ["3\n", "7\n"]  # empty pieces are no steps
    assert response_steps("a ки b ки", " ки") == ["a ки", " b ки"]
    assert response_steps("", "\n") == [] and response_steps(" \n", "\n") == []
    # Cut by the length limit: the unfinished last piece is no step (a finished one gets its separator).
    assert response_steps("3\n7\n9", "\n", finished=False) == ["3\n", "7\n"]
    assert response_steps("3\n7\n", "\n", finished=False) == ["3\n", "7\n"]


def test_the_process_reward_of_a_response_is_its_weakest_steps_score(tiny_model, tokenizer, tmp_path):
    """The scorer's process_rewards against the model scoring each response alone, unpadded, at the last token
    of each step as training tokenized it; a response without a step scores what the round gives it."""
    import torch

    from engines.rollout.base import Rollout

    from engines import models
    from engines.rl.scoring import ScorerActor
    from engines.steps import solution_tensors

    prm = models.load_scalar_model(tiny_model, "float32", tokenizer.pad_token_id)
    torch.manual_seed(0)
    torch.nn.init.normal_(prm.score.weight, std=0.5)  # a fresh head scores every position 0
    models.save_pretrained(prm, tokenizer, tmp_path / "prm")
    scorer = ScorerActor(None, None, process_path=str(tmp_path / "prm"), micro_batch_size=2)
    prompts = [tokenizer("Which digit is largest? 3 7 9", add_special_tokens=False)["input_ids"],
               tokenizer("Which digit is largest? 5 1", add_special_tokens=False)["input_ids"]] * 2
    texts = ["3\n7\n9", "5\n5", "", "9"]
    rollouts = [Rollout(prompt_index=i, prompt_ids=p, token_ids=[], text=t, logprobs=[], finished=True)
                for i, (p, t) in enumerate(zip(prompts, texts))]
    batch = solution_tensors(tokenizer, rollouts, "\n")
    assert batch["step_mask"].sum(1).tolist() == [3, 2, 0, 1]
    for how, pick in (("min", min), ("last", lambda v: v[-1]), ("mean", lambda v: sum(v) / len(v))):
        got = scorer.process_rewards(batch, how, -7.0)
        want = []
        for ids, text in zip(prompts, texts):
            scores = _alone(prm, tokenizer, ids, text)
            want.append(pick(scores) if scores else -7.0)
        assert got.tolist() == pytest.approx(want, abs=1e-5), how
    assert len(set(scorer.process_rewards(batch, "min", -7.0).tolist())) > 2  # the steps are told apart


def _alone(prm, tokenizer, prompt_ids: list[int], text: str) -> list[float]:
    """Each step's score, the model reading the response alone, unpadded, up to that step's last token."""
    import torch

    from engines.steps import response_steps, step_scores

    scores = []
    for k in range(1, len(response_steps(text, "\n")) + 1):
        pieces = tokenizer(response_steps(text, "\n")[:k], add_special_tokens=False)["input_ids"]
        seq = torch.tensor([prompt_ids + [t for p in pieces for t in p]])
        with torch.no_grad():
            scores.append(float(step_scores(prm, {"input_ids": seq, "attention_mask": torch.ones_like(seq)})[0, -1]))
    return scores


def _plain_step_ends(tokenizer, r, separator: str) -> list[int]:
    """By hand: each step's end in the text (after its separator, or a finished text's end), then the first
    token whose plain decode of the tokens up to it is that long, not counting the U+FFFD of a character whose
    bytes have not all come."""
    marks, at = [], 0
    while (found := r.text.find(separator, at)) >= 0:
        if r.text[at:found].strip():
            marks.append(found + len(separator))
        at = found + len(separator)
    if r.finished and r.text[at:].strip():
        marks.append(len(r.text))
    return [next(k for k in range(len(r.token_ids)) if len(tokenizer.decode(r.token_ids[:k + 1]).rstrip("\ufffd"))
                 >= m) for m in marks]


def _responses(tokenizer, texts: list[str], finished: list[bool]) -> list:
    from engines.rollout.base import Rollout
    from engines.rollout.texts import response_texts

    prompt = tokenizer("Which digit is largest? 3 7 9", add_special_tokens=False)["input_ids"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    decoded = response_texts(tokenizer, [prompt] * len(ids), ids)  # as a round decodes them
    return [Rollout(prompt_index=i, prompt_ids=prompt, token_ids=t, text=d, logprobs=[0.0] * len(t), finished=f)
            for i, (t, d, f) in enumerate(zip(ids, decoded, finished))]


@pytest.mark.parametrize("separator,texts,counts", [
    ("\n", ["3\n7\n9", "3\n\n7\n", "x", "", "12 ab\ncd", "é1\n€\n2"], [3, 2, 1, 0, 2, 2]),
    (" ки", ["a ки b ки c", "ки ки", "один ки два", "x ки y ки"], [3, 1, 2, 2]),  # multi-byte, several characters
])
def test_a_responses_steps_end_on_the_policys_token_that_completes_them(tokenizer, separator, texts, counts):
    from engines.rl.process import _searched, step_end_tokens
    from engines.steps import step_spans

    finished = [True] * (len(texts) - 1) + [False]  # the last hit the length limit: its last piece is no step
    rollouts = _responses(tokenizer, texts, finished)
    got = step_end_tokens(tokenizer, rollouts, separator)  # a fast tokenizer: each response decoded as a stream
    marks = [[end for _, end in step_spans(r.text, separator, r.finished)] for r in rollouts]
    assert got == _searched(tokenizer, rollouts, marks)  # as another tokenizer's are found: by prefix decodes
    assert got == [_plain_step_ends(tokenizer, r, separator) for r in rollouts]
    assert [len(e) for e in got] == counts


def test_a_dense_process_reward_puts_each_steps_score_at_its_last_token(tiny_model, tokenizer, tmp_path):
    """reward dense: true: the weighted score of each step where the policy's tokens complete it, as the model
    scores the response alone; a response without a step gets no_step_reward at its last token."""
    import torch

    from alignflow.config.round.reward import RewardSourceConfig
    from engines import models
    from engines.rl.process import process_reward
    from engines.rl.scoring import ScorerActor

    prm = models.load_scalar_model(tiny_model, "float32", tokenizer.pad_token_id)
    torch.manual_seed(1)
    torch.nn.init.normal_(prm.score.weight, std=0.5)
    models.save_pretrained(prm, tokenizer, tmp_path / "prm")
    scorer = ScorerActor(None, None, process_path=str(tmp_path / "prm"), micro_batch_size=3)
    texts = ["3\n7\n9", " \n", "5\n5\n"]
    rollouts = _responses(tokenizer, texts, [True] * 3)
    prompt = rollouts[0].prompt_ids
    source = RewardSourceConfig(source="process_model", dense=True, weight=0.5, no_step_reward=-7.0)
    width = max(len(r.token_ids) for r in rollouts)
    got = process_reward(lambda method, *args: getattr(scorer, method)(*args), tokenizer, rollouts, "\n", source,
                         width)
    ends = [_plain_step_ends(tokenizer, r, "\n") for r in rollouts]
    assert got.steps.rewards.shape == got.steps.ends.shape == (3, width)
    for b, (r, text) in enumerate(zip(rollouts, texts)):
        scores = _alone(prm, tokenizer, prompt, text) or [-7.0]
        at = ends[b] or [len(r.token_ids) - 1]
        want_r, want_e = torch.zeros(width), torch.zeros(width)
        for value, t in zip(scores, at):
            want_r[t] += 0.5 * value
            want_e[t] = 1.0
        torch.testing.assert_close(got.steps.rewards[b], want_r, atol=1e-5, rtol=1e-5)
        assert got.steps.ends[b].tolist() == want_e.tolist()
        assert got.sequence[b].item() == pytest.approx(sum(scores), abs=1e-5)
    assert got.metrics["process/responses_without_steps"] == 1.0
    assert got.metrics["process/steps_per_response"] == pytest.approx(5 / 3)
