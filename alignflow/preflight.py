"""Preflight: what a run needs outside its config, checked in seconds before Prefect or Ray start
(`alignflow validate`, and the start of `run` / `stage`): data files exist and every row of a
local one parses (of a remote one, the first `data.preflight_rows`: alignflow/data/checks.py); model.base,
a distillation round's teacher and a judge load; explicit lengths, and a judge engine's max_model_len, fit
their model's positions; rule rewards, the checker and environments (with their tools' schemas) import;
remote reward services answer; the storage root, and a SQLite tracking file's directory, take a probe; a local
Ray can place each stage.

Every problem is collected, naming its field and where its value came from (the file, or a
command-line override), into one ConfigError. Heavy imports (transformers) stay inside checks.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import fsspec  # imported by alignflow.storage anyway

from alignflow.config import PipelineConfig
from alignflow.config.loading import ConfigSources, config_sources
from alignflow.data.checks import check_files
from alignflow.errors import ConfigError
from alignflow.mlflow_inputs import sqlite_file
from alignflow.redact import redact_url
from alignflow.slots import check_slots
from alignflow.storage import is_local_uri, local_path

REMOTE_TIMEOUT_CAP_S = 10.0


class Findings:
    """Checks run and problems found, each problem one line: `field: what (where it was set)`."""

    def __init__(self, sources: ConfigSources):
        self.sources, self.checks, self.problems = sources, 0, []
        self.notes: list[str] = []  # what was not checked, and why (e.g. a remote file's rows past a budget)

    def ok(self) -> None:
        self.checks += 1

    def fail(self, field: str, text: str, also: tuple[str, ...] = ()) -> None:
        self.checks += 1
        where = "; ".join([self.sources.of(field), *(f"{f}: {self.sources.of(f)}" for f in also)])
        self.problems.append(f"{field}: {text} ({where})")


def preflight(cfg: PipelineConfig, overrides: list[str] | None = None, config_path: str | Path | None = None,
              sources: ConfigSources | None = None) -> Findings:
    """Run every check on a loaded config (`config_path` and `overrides` as given to load_config, or
    `sources` as config_from_parameter returned them)."""
    found = Findings(sources or config_sources(config_path, overrides))
    positions = _model(cfg, found)
    _named_models(cfg, found, positions)
    check_files(cfg, found)
    if positions is not None:
        _lengths(cfg, positions, found)
    _rewards(cfg, found)
    _storage(cfg, found)
    _tracking_store(cfg, found)
    check_slots(cfg, found)
    return found


def check(cfg: PipelineConfig, overrides: list[str] | None = None, config_path: str | Path | None = None,
          sources: ConfigSources | None = None) -> Findings:
    """preflight, raising one ConfigError that lists every problem; else what it found (checks, notes)."""
    found = preflight(cfg, overrides, config_path, sources)
    if n := len(found.problems):
        raise ConfigError(f"preflight found {n} problem{'s' * (n > 1)}:\n  " + "\n  ".join(found.problems))
    for note in found.notes:
        print(f"preflight: {note}", file=sys.stderr)
    return found


def _model(cfg: PipelineConfig, found: Findings) -> int | None:
    """The base model's positions (None when it cannot be loaded)."""
    if cfg.model.base == "tiny":
        return cfg.model.tiny.max_position_embeddings
    return _model_at("model.base", cfg.model.base, found, cfg.model.revision)


def _named_models(cfg: PipelineConfig, found: Findings, base: int | None) -> None:
    """Models the config names by path: a distillation teacher that is no policy of the pipeline (a round's or
    the distill stage's), a judge; and a judge engine's max_model_len against its model's positions (the
    pipeline's own judge starts from the base model: `base`'s)."""
    for i, r in enumerate(cfg.rounds):
        if r.teacher and r.teacher not in cfg.policies_before(i):
            _model_at(f"rounds.{i}.teacher", r.teacher, found, r.teacher_revision, f"rounds.{i}.teacher_revision")
        j, field = r.reward.judge, f"rounds.{i}.reward.judge"
        has = r.reward.uses_judge and (base if j.model is None else _model_at(f"{field}.model", j.model, found,
                                                                               j.revision, f"{field}.revision"))
        try:
            if has:
                j.generation.engine_positions(has)
        except ValueError as err:
            found.fail(f"{field}.generation.max_model_len", str(err))
    if cfg.distill is not None and cfg.distill.teacher not in cfg.policies_before(len(cfg.rounds)):
        _model_at("distill.teacher", cfg.distill.teacher, found, cfg.distill.teacher_revision,
                  "distill.teacher_revision")


def _model_at(field: str, base: str, found: Findings, revision: str | None = None,
              revision_field: str = "model.revision") -> int | None:
    """The positions of the model a field names (a directory, or a hub id at `revision`, which
    `revision_field` sets); None when it cannot be loaded."""
    path = local_path(base) if is_local_uri(base) else None  # as tasks/base_model.py: a directory, or a hub id
    local = path is not None and (path.exists() or base.startswith(("/", ".", "~", "file://")))
    if local and revision is not None:
        return found.fail(revision_field, f"{revision!r} names a hub model's branch, tag or commit, but "
                          f"{field} {base} is a local directory")
    try:
        if local:
            problem = (f"{base} does not exist (a local model directory, or a hub id where a hub is reachable)"
                       if not path.exists() else f"{base} is a file, not a model directory" if not path.is_dir()
                       else None if (path / "config.json").is_file()
                       else f"{base} holds no config.json (not a transformers model directory)")
            if problem:
                return found.fail(field, problem)
            from transformers import AutoConfig, AutoTokenizer

            config = AutoConfig.from_pretrained(str(path))
            AutoTokenizer.from_pretrained(str(path))
        else:
            config = _hub_config(base, revision)
    except Exception as err:  # noqa: BLE001  (whatever transformers raises, the user fixes the field)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        what = ("its config or tokenizer does not load" if local else
                f"is no local directory{f' (none at {path})' if path else ''} and does not load as a hub id"
                f"{f' at revision {revision!r}' if revision else ''}")
        return found.fail(field, f"{base} {what}: {first}")
    found.ok()
    names = ("max_position_embeddings", "n_positions", "max_sequence_length")  # as engines/models.py
    return next((int(getattr(config, n)) for n in names if getattr(config, n, None)), None)


def _hub_config(base: str, revision: str | None = None):
    """A hub id's config at `revision`: from the local cache, else from a hub that answers within seconds
    (transformers alone retries an unreachable hub for ~30 s)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(base, local_files_only=True, revision=revision)
    except OSError:
        if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "false", "no", "off", ""):
            raise OSError("not in the local cache, and HF_HUB_OFFLINE is set") from None
    hub = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    headers = {"Authorization": f"Bearer {os.environ['HF_TOKEN']}"} if os.environ.get("HF_TOKEN") else {}
    at = f"/revision/{urllib.parse.quote(revision, safe='')}" if revision else ""
    request = urllib.request.Request(f"{hub}/api/models/{base}{at}", headers=headers)
    try:
        urllib.request.urlopen(request, timeout=5).close()
    except urllib.error.HTTPError as err:
        raise OSError(f"{hub} has no model {base}{f' at revision {revision}' if revision else ''} (HTTP {err.code}; "
                      "a gated or private one needs HF_TOKEN)") from None
    except OSError as err:
        raise OSError(f"the hub {hub} cannot be reached ({getattr(err, 'reason', err)})") from None
    return AutoConfig.from_pretrained(base, revision=revision)


def _lengths(cfg: PipelineConfig, positions: int, found: Findings) -> None:
    """Explicit limits and every generation's max_new_tokens against the model's positions."""
    limit = "model.tiny.max_position_embeddings" if cfg.model.base == "tiny" else "model.base config.json"
    have = f"the model has {positions} ({limit})"
    prompt, response = cfg.data.max_prompt_tokens, cfg.data.max_response_tokens
    gens = [(f"rounds.{i}.generation.max_new_tokens", r.generation.max_new_tokens) for i, r in enumerate(cfg.rounds)]
    if cfg.evaluation is not None:
        gens.append(("evaluation.generation.max_new_tokens", cfg.evaluation.generation.max_new_tokens))
    for field, new in gens:
        if prompt == "auto" and new >= positions:
            found.fail(field, f"{new} new tokens leave no position for a prompt: {have}")
        elif prompt != "auto" and prompt + new > positions:
            found.fail(field, f"{new} new tokens after prompts of up to data.max_prompt_tokens={prompt} need "
                              f"{prompt + new} positions; {have}", also=("data.max_prompt_tokens",))
        else:
            found.ok()
    if prompt != "auto" and prompt >= positions:
        found.fail("data.max_prompt_tokens", f"{prompt} leaves no position for a response: {have}")
    elif prompt != "auto" and response != "auto" and prompt + response > positions:
        found.fail("data.max_response_tokens", f"data.max_prompt_tokens={prompt} + data.max_response_tokens="
                   f"{response} = {prompt + response} exceed the positions: {have}", also=("data.max_prompt_tokens",))
    else:
        found.ok()


def _callable(field: str, path: str, found: Findings) -> None:
    """`module:function` imports and is callable (as alignflow/config/loading.py load_callable loads it)."""
    module, _, name = path.partition(":")
    if not name:
        return found.fail(field, f"{path!r} must be 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception as err:  # noqa: BLE001  (the module may fail in any way while importing)
        return found.fail(field, f"{path!r} cannot be imported: {type(err).__name__}: {err}")
    found.ok() if callable(fn) else found.fail(field, f"{path!r} is not callable")


def _remote(field: str, url: str, timeout_s: float, found: Findings) -> None:
    """One request in engines/rl/rewards.py RemoteReward's protocol (POST prompts/responses/answers -> rewards)."""
    body = json.dumps({"prompts": ["preflight"], "responses": ["preflight"], "answers": [None]}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    shown = redact_url(url)  # what the findings say: the URL without its credentials
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            rewards = json.loads(resp.read())["rewards"]
        [value] = rewards  # ValueError unless exactly one
        float(value)
    except urllib.error.HTTPError as err:
        return found.fail(field, f"{shown} answered a test request with HTTP {err.code}")
    except OSError as err:  # URLError (refused, unknown host), a timeout
        return found.fail(field, f"{shown} did not answer a test request (timeout {timeout_s:g} s): "
                                 f"{getattr(err, 'reason', err)}")
    except (ValueError, KeyError, TypeError) as err:
        return found.fail(field, f"{shown} answered a test request without a list 'rewards' of one number: {err}")
    found.ok()


def _rewards(cfg: PipelineConfig, found: Findings) -> None:
    for i, r in enumerate(cfg.rounds):
        for field, c in r.reward.source_fields(f"rounds.{i}.reward"):
            if c.source == "rule":
                _callable(f"{field}.rule", c.rule, found)
            elif c.source == "remote":
                _remote(f"{field}.url", c.url, min(c.timeout_s, REMOTE_TIMEOUT_CAP_S), found)
    if cfg.evaluation is not None:
        _callable("evaluation.checker", cfg.evaluation.checker, found)
    envs = [(f"rounds.{i}.environment", r.environment) for i, r in enumerate(cfg.rounds)]
    for field, env in envs + [("evaluation.environment", cfg.evaluation and cfg.evaluation.environment)]:
        if env is not None and env.agent:
            _callable(f"{field}.agent", env.agent, found)
        elif env is not None:  # imports, is an environment, constructs, and its tools carry schemas
            from alignflow.agents.environment import make_environment

            try:
                make_environment(env.name, env.kwargs, field)
                found.ok()
            except ValueError as err:
                found.fail(*str(err).split(": ", 1))


def _unwritable(path: Path) -> str | None:
    """Why a probe file cannot be written into `path` (made if missing); None where it can. The probe, and the
    directories made for it, are removed again."""
    created: list[Path] = []
    try:
        created = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
        path.mkdir(parents=True, exist_ok=True)
        (probe := path / f".preflight-{uuid.uuid4().hex}").write_bytes(b"ok")
        probe.unlink()
    except OSError as err:  # a directory on the way that is a file, or that cannot be entered
        at = f" ({err.filename})" if err.filename and str(err.filename) != str(path) else ""
        return f"{err.strerror or err}{at}"
    finally:
        for p in created:
            with contextlib.suppress(OSError):
                p.rmdir()
    return None


def _tracking_store(cfg: PipelineConfig, found: Findings) -> None:
    """A SQLite tracking file's directory takes a probe, and the file, where it exists, is a writable file
    (MLflow makes the file and its tables as the run starts). A tracking server, or another database, is the
    flow's to open: its errors are the run's."""
    field, uri = "infra.mlflow_tracking_uri", cfg.infra.mlflow_tracking_uri
    if (file := sqlite_file(uri)) is None:
        return
    path = local_path(str(file))
    if why := _unwritable(path.parent):
        return found.fail(field, f"{uri}: its directory {path.parent} is not writable: {why}")
    if path.exists() and not (path.is_file() and os.access(path, os.W_OK)):
        return found.fail(field, f"{uri}: {path} is not a writable file")
    found.ok()


def _storage(cfg: PipelineConfig, found: Findings) -> None:
    field, root, probe = "infra.storage.root", cfg.infra.storage.root, f".preflight-{uuid.uuid4().hex}"
    if is_local_uri(root):
        if why := _unwritable(local_path(root)):
            return found.fail(field, f"{root} is not writable: {why}")
        return found.ok()
    protocol, uri, options = root.split("://", 1)[0], f"{root.rstrip('/')}/{probe}", {}
    if protocol == "s3":  # as alignflow/storage.py Storage._fs, with short timeouts and one retry
        endpoint = cfg.infra.storage.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
        options = {"skip_instance_cache": True, "client_kwargs": {"endpoint_url": endpoint} if endpoint else {},
                   "config_kwargs": {"connect_timeout": 5, "read_timeout": 10, "retries": {"max_attempts": 2}}}
    try:
        fs = fsspec.filesystem(protocol, **options)
        fs.pipe(uri, b"ok")
        fs.rm(uri)
    except Exception as err:  # noqa: BLE001  (credentials, endpoint, bucket: the user's to fix)
        return found.fail(field, f"{root} does not take a probe object: {type(err).__name__}: {err}")
    found.ok()
