"""Preflight's models: each model a config names loads (a directory, or a hub id), and what must fit its
positions does."""

from __future__ import annotations

import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from alignflow.config import PipelineConfig
from alignflow.preflight.findings import Findings
from alignflow.store.storage import is_local_uri, local_path


def check_models(cfg: PipelineConfig, found: Findings) -> int | None:
    """Every model the config names loads, and LoRA's target_modules name linear layers of the base model's;
    the base model's positions (None where it does not load)."""
    config, tokenizers = None, {}  # the tokenizers loaded, by path: each once, for the teachers' check too
    if cfg.model.base == "tiny":  # its transformers config (an import of seconds) only where LoRA targets need it
        positions, base = cfg.model.tiny.max_position_embeddings, cfg.model.tiny.hf_config
        if cfg.sft is not None and cfg.sft.objective == "dft":
            found.fail("sft.objective", "dft weighs each token's loss by its probability, about 1 / vocabulary on "
                       "the freshly built model of model.base tiny, so SFT barely moves it (the default pipeline's "
                       "SFT stayed at accuracy 0): use nll, or start from a pretrained model", also=("model.base",))
    else:
        config = _model_at("model.base", cfg.model.base, found, cfg.model.revision, tokenizers=tokenizers)
        positions, base = _positions(config), config and (lambda: config)
    _named_models(cfg, found, positions, config, tokenizers)
    if base:
        _lora_targets(cfg, base, found)
    return positions


def _lora_targets(cfg: PipelineConfig, base: Callable[[], Any], found: Findings) -> None:
    """Each LoRA config's target_modules against the modules of the models it adapts, every one of the base
    model's architecture: a policy's (sft, preference, distill, judge, a round's actor) or a scalar model's (the
    reward model, a process reward model, a critic), built on the meta device (no weights: seconds, whatever
    the model's size)."""
    engines = [(name, c, "causal") for name, c in (("sft", cfg.sft), ("preference", cfg.preference),
                                                   ("distill", cfg.distill), ("judge", cfg.judge))]
    engines += [("reward_model", cfg.reward_model, "scalar"),
                ("process_reward_model", cfg.process_reward_model, "scalar")]
    for i, r in enumerate(cfg.rounds):
        engines += [(f"rounds.{i}.actor", r.actor, "causal")] + [(f"rounds.{i}.critic", r.critic, "scalar")] * bool(
            r.spec.critic)
    engines = [(field, c.lora, kind) for field, c, kind in engines if c is not None and c.lora is not None
               and c.lora.target_modules != "all-linear"]
    if not engines:
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from alignflow.config.lora_targets import HEADS, layers_of, target_problem

    models = {}
    for field, lora, kind in engines:
        if kind not in models:
            try:
                with torch.device("meta"):
                    model = (AutoModelForCausalLM.from_config(base()) if kind == "causal" else
                             AutoModelForSequenceClassification.from_config(base()))  # its head: "score"
                models[kind] = (*layers_of(model), HEADS if kind == "scalar" else ())
            except Exception as err:  # noqa: BLE001  (an architecture that does not build so: the trainer's to say)
                models[kind] = None
                found.notes.append(f"{field}.lora.target_modules: not checked, the model does not build on the "
                                   f"meta device ({type(err).__name__}: {err})")
        if models[kind] is None:
            continue
        problem = target_problem(lora.target_modules, *models[kind])
        found.fail(f"{field}.lora.target_modules", problem) if problem else found.ok()


def _positions(config) -> int | None:
    """A transformers config's positions (None: no config, or none it names)."""
    names = ("max_position_embeddings", "n_positions", "max_sequence_length")  # as engines/models.py
    return next((int(getattr(config, n)) for n in names if getattr(config, n, None)), None) if config else None


def _named_models(cfg: PipelineConfig, found: Findings, base: int | None, base_config=None,
                  tokenizers: dict | None = None) -> None:
    """Models the config names by path: a distillation teacher that is no policy of the pipeline (a round's or
    the distill stage's, with its vocabulary against the student's), a judge; and a judge engine's max_model_len
    against its model's positions (the pipeline's own judge starts from the base model: `base`'s)."""
    for i, r in enumerate(cfg.rounds):
        if r.teacher and r.teacher not in cfg.policies_before(i):
            field = f"rounds.{i}.teacher"
            teacher = _model_at(field, r.teacher, found, r.teacher_revision, f"{field}_revision",
                                tokenizers=tokenizers)
            _teacher_vocabulary(cfg, field, (r.teacher, r.teacher_revision), (teacher, base_config), found,
                                tokenizers, sampled=True)
        j, field = r.reward.judge, f"rounds.{i}.reward.judge"
        has = r.reward.uses_judge and (base if j.model is None else _positions(
            _model_at(f"{field}.model", j.model, found, j.revision, f"{field}.revision")))
        try:
            if has:
                j.generation.engine_positions(has)
        except ValueError as err:
            found.fail(f"{field}.generation.max_model_len", str(err))
    if cfg.distill is not None and cfg.distill.teacher not in cfg.policies_before(len(cfg.rounds)):
        d = cfg.distill
        teacher = _model_at("distill.teacher", d.teacher, found, d.teacher_revision, "distill.teacher_revision",
                            tokenizers=tokenizers)
        _teacher_vocabulary(cfg, "distill.teacher", (d.teacher, d.teacher_revision), (teacher, base_config), found,
                            tokenizers, sampled=False)


def _teacher_vocabulary(cfg: PipelineConfig, field: str, named: tuple[str, str | None], configs: tuple,
                        found: Findings, tokenizers: dict | None = None, *, sampled: bool) -> None:
    """A teacher scores the student's token ids: its tokenizer must number every token as model.base's does, and
    (`sampled`: it scores ids the student's engines sample) its output layer have as many rows. Checked here where
    both tokenizers are on this machine (directories, the hub cache); else when its stage starts (tasks/).
    `named`: the teacher's path and revision; `configs`: its transformers config and model.base's; `tokenizers`:
    those loaded already, by path (`_model_at`'s)."""
    teacher_config, base_config = configs
    if teacher_config is None:
        return  # its own finding already
    tokenizers = {} if tokenizers is None else tokenizers
    teacher = _tokenizer_at(*named, tokenizers)
    student = None if cfg.model.base == "tiny" else _tokenizer_at(cfg.model.base, cfg.model.revision, tokenizers)
    if teacher is None or student is None:
        why = ("the tiny model's tokenizer is built by the base_model stage" if cfg.model.base == "tiny" else
               "a tokenizer is not on this machine yet")
        found.notes.append(f"{field}: its tokenizer is compared with the student's when its stage starts ({why})")
        return
    if teacher.get_vocab() != student.get_vocab():
        return found.fail(field, f"its tokenizer is not model.base's ({len(teacher)} against {len(student)} tokens, "
                                 f"or the same count numbered differently); distillation scores the student's "
                                 f"token ids with it")
    rows, student_rows = getattr(teacher_config, "vocab_size", None), getattr(base_config, "vocab_size", None)
    if sampled and rows and student_rows and rows < student_rows:
        return found.fail(field, f"the teacher's output layer has {rows} rows, model.base's {student_rows}: the "
                                 f"student may sample an id past the teacher's, which it cannot score")
    found.ok()


def _tokenizer_at(base: str, revision: str | None, tokenizers: dict):
    """The tokenizer of a model directory, or of a hub id in the local cache; None where neither loads. Each is
    loaded once, kept in `tokenizers` by path."""
    from transformers import AutoTokenizer

    if base not in tokenizers:
        path = local_path(base) if is_local_uri(base) else None
        try:
            tokenizers[base] = (AutoTokenizer.from_pretrained(str(path)) if path is not None and path.is_dir() else
                                AutoTokenizer.from_pretrained(base, local_files_only=True, revision=revision))
        except Exception:  # noqa: BLE001  (not cached, or not loadable: the stage that fetches it says why)
            tokenizers[base] = None
    return tokenizers[base]


def _model_at(field: str, base: str, found: Findings, revision: str | None = None,
              revision_field: str = "model.revision", *, tokenizers: dict | None = None):
    """The transformers config of the model a field names (a directory, or a hub id at `revision`, which
    `revision_field` sets); None when it cannot be loaded. A directory's tokenizer, loaded to check it, is kept
    in `tokenizers` by path."""
    path = local_path(base) if is_local_uri(base) else None  # as tasks/stages/base_model.py: a directory, or a hub id
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
            if tokenizers is None or tokenizers.get(base) is None:  # one another field named is loaded already
                tokenizer = AutoTokenizer.from_pretrained(str(path))
                if tokenizers is not None:
                    tokenizers[base] = tokenizer
        else:
            config = _hub_config(base, revision)
    except Exception as err:  # noqa: BLE001  (whatever transformers raises, the user fixes the field)
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        what = ("its config or tokenizer does not load" if local else
                f"is no local directory{f' (none at {path})' if path else ''} and does not load as a hub id"
                f"{f' at revision {revision!r}' if revision else ''}")
        return found.fail(field, f"{base} {what}: {first}")
    found.ok()
    return config


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


def check_lengths(cfg: PipelineConfig, positions: int, found: Findings) -> None:
    """Explicit limits, and what every generation samples after its prompt (max_new_tokens; an environment's
    max_episode_tokens), against the model's positions."""
    limit = "model.tiny.max_position_embeddings" if cfg.model.base == "tiny" else "model.base config.json"
    have = f"the model has {positions} ({limit})"
    prompt, response = cfg.data.max_prompt_tokens, cfg.data.max_response_tokens
    sampled = [(f"rounds.{i}", r) for i, r in enumerate(cfg.rounds)] + [("evaluation", cfg.evaluation)] * bool(
        cfg.evaluation)
    # What follows a prompt: a response's new tokens; in an environment, an episode's (its turns and observations).
    gens = [(f"{at}.environment.max_episode_tokens", c.environment.max_episode_tokens) if c.environment else
            (f"{at}.generation.max_new_tokens", c.generation.max_new_tokens) for at, c in sampled]
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
