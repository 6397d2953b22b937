"""Preflight's data checks (alignflow/preflight/): each data file a config names exists, and every row
of a local one (of a remote one, the first `data.preflight_rows`) parses as its kind's row."""

from __future__ import annotations

from itertools import islice

import fsspec

from alignflow.config import DatasetSource, PipelineConfig
from alignflow.data.formats import FILE_FORMATS, file_format, read_rows
from alignflow.data.load import held_out_count
from alignflow.data.rows import normalize_row
from alignflow.errors import DataError
from alignflow.store.storage import is_local_uri, local_path

MAX_BAD_ROWS = 10  # listed per file; the rest are counted
MATH_RULES = ("alignflow.rewards:math_equal", "alignflow.rewards.math:math_equal")
MATH_CHECK_ROWS = 1000  # answers the math rule's parser reads in preflight (sympy: about 1 ms each)


def check_batches(cfg: PipelineConfig, found, sft_rows: int | None, pairs: int | None = None, unpaired: int = 0,
                  solutions: int | None = None) -> None:
    """A training stage's batch against the rows it can have at most: the synthetic task's counts, or a local SFT
    file's rows (`sft_rows`), a preference file's `pairs` and `unpaired` (KTO's) rows and a process file's
    `solutions`; prompts too long for data.max_prompt_tokens are left out of them later, and about 10 % of the
    pairs and solutions held out."""
    counts = {}  # stage -> (the most it trains on, in what, the field that sets it)
    kto = cfg.preference is not None and cfg.preference.loss == "kto"
    if cfg.data.source == "synthetic":
        s = cfg.data.synthetic
        task_pairs = (s.num_preference, "pairs", "data.synthetic.num_preference")
        kto_rows = (2 * s.num_preference, "rows (KTO's: each pair's two replies)", task_pairs[2])
        counts = {"reward_model": task_pairs, "preference": kto_rows if kto else task_pairs,
                  "process_reward_model": (_trained(s.num_process), "solutions (less about 10 % held out)",
                                           "data.synthetic.num_process")}
        if s.task == "largest_digit":  # the boxes task writes two rows of some traces
            counts["sft"] = (s.num_sft, "rows", "data.synthetic.num_sft")
    else:
        if sft_rows is not None:
            counts["sft"] = (sft_rows, "rows", "data.sft.path")
        if pairs is not None:  # at most (KTO: each pair's two replies as rows, and its unpaired rows)
            field = "data.preference.path"
            counts |= {"reward_model": (pairs, "pairs of data.preference", field),
                       "judge": (2 * pairs, "verdicts (one for each reply of a pair)", field),
                       "preference": (2 * pairs + unpaired, "rows (each pair's two replies, and the unpaired "
                                      "rows)", field) if kto else (pairs, "pairs of data.preference", field)}
        if solutions is not None:
            counts["process_reward_model"] = (_trained(solutions), "solutions of data.process (less about 10 % "
                                              "held out)", "data.process.path")
    for stage, (most, unit, source) in counts.items():
        train = getattr(cfg, stage)
        if train is not None and (stage != "reward_model" or cfg.trains_reward_model) and most < train.batch_size:
            found.fail(f"{stage}.batch_size", f"{train.batch_size} is more than the {most} {unit} it can train on",
                       also=(source,))


def _trained(n: int) -> int:
    """Step-labelled solutions left to train on, less those tasks/stages/data.py holds out (one alone is kept for
    both)."""
    return n - held_out_count(n) if n > 1 else n


def check_files(cfg: PipelineConfig, found) -> None:
    """The data files, into preflight's `found` (a Findings)."""
    if cfg.data.source != "files":
        return check_batches(cfg, found, None)
    rows: dict[str, int] = {}  # a local file's rows, read whole
    if cfg.data.prompts is None:  # the RL prompts are the SFT prompts, without answers
        _answers_read(cfg, "prompts", "data.prompts", "no data.prompts is given, so the RL prompts are the SFT "
                      "prompts, without answers", found)
    for name, kind in (("sft", "sft"), ("preference", "preference"), ("prompts", "prompts"), ("eval", "prompts"),
                       ("process", "process")):
        src: DatasetSource | None = getattr(cfg.data, name)
        if src is None:
            continue
        field, path = f"data.{name}.path", src.path
        if not file_format(path):
            _datasets_name(field, path, found)
            continue
        try:
            exists = local_path(path).is_file() if is_local_uri(path) else fsspec.core.url_to_fs(path)[0].exists(path)
        except Exception as err:  # noqa: BLE001  (any filesystem's failure is the user's to see)
            found.fail(field, f"{path} cannot be reached: {type(err).__name__}: {err}")
            continue
        if not exists:
            found.fail(field, f"{path} does not exist")
            continue
        limit = None if is_local_uri(path) else cfg.data.preflight_rows
        math = [reader for reader, rule in _readers(cfg, name) if rule in MATH_RULES]
        math_rows = min(k for k in (limit, MATH_CHECK_ROWS) if k) if math else 0
        try:
            n, bad, unanswered, unreadable, unpaired = _rows(src, kind, limit, math_rows)
        except Exception as err:  # noqa: BLE001  (a filesystem failing mid-read, a `datasets` error, ...)
            found.fail(field, f"{path} cannot be read: {type(err).__name__}: {err}")
            continue
        for text in bad[:MAX_BAD_ROWS]:
            found.fail(f"data.{name}", text)
        if len(bad) > MAX_BAD_ROWS:
            found.fail(f"data.{name}", f"{path}: {len(bad) - MAX_BAD_ROWS} more bad rows (of {n} read)")
        if not bad:
            found.ok() if n else found.fail(field, f"{path} holds no rows")
        if unanswered and not bad and name in ("prompts", "eval"):
            shown = ", ".join(map(str, unanswered[:5])) + (", ..." if len(unanswered) > 5 else "")
            _answers_read(cfg, name, f"data.{name}.answer_key", f"{path}: {len(unanswered)} of {n} rows have no "
                          f"{src.answer_key!r} (rows {shown})" if src.answer_key else
                          f"{path}: data.{name}.answer_key is None, so no row has an answer", found)
        if unreadable and not bad:  # every one: a problem; some (an interval, a variable): a note
            shown = "; ".join(f"row {r}: {a[:40]!r}" for r, a in unreadable[:3]) + "; ..." * (len(unreadable) > 3)
            checked = min(n, math_rows)
            text = (f"{path}: {len(unreadable)} of the first {checked} rows have an answer that {math[0]} "
                    f"({MATH_RULES[0]}) cannot read as a number or expression ({shown}), so every response to them "
                    "would score 0: give the final answer alone (GSM8K's is what follows '####')")
            if len(unreadable) == checked - sum(r <= checked for r in unanswered):
                found.fail(f"data.{name}.answer_key", text, also=tuple(math))
            else:
                found.notes.append(f"data.{name}.answer_key: {text}")
        if name in ("sft", "preference", "process") and limit is None and not bad:
            rows[name], rows["unpaired"] = n - unpaired, rows.get("unpaired", 0) + unpaired  # pairs apart
        if limit is not None and n == limit:
            found.notes.append(f"data.{name}: {path} is remote, so its first {limit} rows were checked "
                               "(data.preflight_rows); the data stage checks the rest")
    check_batches(cfg, found, rows.get("sft"), rows.get("preference"), rows.get("unpaired", 0), rows.get("process"))


def _datasets_name(field: str, path: str, found) -> None:
    """A data path of none of the file formats: a `datasets` name, which loading may download (the data stage
    reports it), unless it is plainly a file, which would fail there after Prefect and Ray started."""
    formats = ", ".join(FILE_FORMATS)
    local = local_path(path) if is_local_uri(path) else None
    if local is not None and local.is_file():
        found.fail(field, f"{path} is a file of none of the formats alignflow reads ({formats}, any case)")
    elif local is not None and local.is_dir():  # datasets.load_dataset reads a directory of data files
        found.notes.append(f"{field}: {path} is a directory, so the data stage loads it with datasets.load_dataset; "
                           f"not checked here ({found.sources.of(field)})")
    elif local is None or path.startswith(("/", "./", "../", "~", "file://")):
        found.fail(field, f"{path}: alignflow reads {formats} files (any case) and datasets names, and this "
                          "path is neither")
    else:
        found.notes.append(f"{field}: {path!r} is no {formats} file, so the data stage loads it with "
                           "datasets.load_dataset (a hub name); not checked here "
                           f"({found.sources.of(field)})")


def _readers(cfg: PipelineConfig, split: str) -> list[tuple[str, str]]:
    """(field, module:function) of what scores a response against its row's answer in `split`."""
    readers = []
    if split == "eval" and cfg.evaluation is not None and cfg.evaluation.environment is None:
        readers.append(("evaluation.checker", cfg.evaluation.checker))
    if split == "prompts":
        readers += [(f"{f}.rule", c.rule) for i, r in enumerate(cfg.rounds) if r.environment is None
                    for f, c in r.reward.source_fields(f"rounds.{i}.reward") if c.source == "rule"]
    return readers


def _answers_read(cfg: PipelineConfig, split: str, field: str, why: str, found) -> None:
    """Rows of `split` without an answer, where something scores against answers: alignflow's own
    checker, rule reward or math verifier would score every such response wrong (a problem); a user's
    function may not read the answer (a note)."""
    for reader, path in _readers(cfg, split):
        if path.startswith("alignflow."):
            found.fail(field, f"{why}; {reader} ({path}) scores every response against its row's answer, so "
                              f"each of them would score as wrong: give every row an answer", also=(reader,))
        else:
            found.notes.append(f"{field}: {why}; {reader} ({path}) gets answer=None for them")


def _rows(src: DatasetSource, kind: str, limit: int | None, math_rows: int = 0
          ) -> tuple[int, list[str], list[int], list[tuple[int, str]], int]:
    """(rows read, one message per bad row, the rows without an answer, (row, answer) of those among the first
    `math_rows` whose answer `math_equal` cannot parse, the unpaired preference rows (KTO's, with a label)):
    every row, or the first `limit`. A row that is not JSON ends the file's reading (the next rows cannot be
    told apart)."""
    if math_rows:
        from alignflow.rewards.math import parse_math  # sympy: only where a math rule reads the answers

    rows, bad, unanswered, unreadable, n, unpaired = read_rows(src), [], [], [], 0, 0
    try:
        for n, row in enumerate(islice(rows, limit) if limit else rows, start=1):
            try:
                record = normalize_row(row, kind, src, where=f"{src.path}, row {n}")
            except DataError as err:
                bad.append(str(err))
                continue
            answer, unpaired = record.get("answer", ""), unpaired + ("label" in record)
            if answer is None:
                unanswered.append(n)
            elif n <= math_rows and answer and parse_math(answer) is None:
                unreadable.append((n, answer))
    except DataError as err:  # from read_rows: not JSON, not UTF-8, not Parquet, not a list
        bad.append(str(err))
    return n, bad, unanswered, unreadable, unpaired
