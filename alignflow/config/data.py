"""Where prompts, demonstrations, preference pairs and eval prompts come from."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, model_validator

from alignflow.config.base import Section


STEP_SEPARATOR = "\n"  # what follows each step of the bundled task's step-labelled solutions


class SyntheticTaskConfig(Section):
    """The bundled "largest digit" task (see alignflow.data.synthetic).

    A prompt lists `num_digits` digits; the checkable answer is the largest.
    SFT demonstrations give the correct answer with probability
    `sft_correct_fraction` and otherwise the first digit (a bad habit the RL
    rounds should remove). Its seed derives from the pipeline seed.
    """

    task: Literal["largest_digit", "boxes"] = Field(
        "largest_digit", description="largest_digit: the default; boxes: the agent task, answerable only through a "
        "tool (alignflow/data/agent_task.py, environment boxes)")
    num_digits: int = Field(5, ge=2, le=10, description="distinct digits in each prompt (largest_digit; the boxes "
                            "task's prompts are its own)")
    num_sft: int = Field(2000, ge=1, description="SFT demonstrations")
    num_preference: int = Field(2000, ge=1, description="preference pairs (correct answer chosen)")
    num_rl_prompts: int = Field(512, ge=1, description="RL prompts, with answers")
    num_eval: int = Field(200, ge=1, description="held-out eval prompts (and as many held-out pairs)")
    sft_correct_fraction: float = Field(
        0.35, ge=0.0, le=1.0, description="share of SFT demonstrations answering correctly (the rest: the bad habit)")
    num_process: int = Field(
        0, ge=0, description="step-labelled solutions for a process reward model (largest_digit: the running "
        "largest digit, a step per digit; about 10% held out); 0: none")

    @model_validator(mode="after")
    def _enough_prompts(self) -> SyntheticTaskConfig:
        if self.task == "largest_digit":  # every row of every split is a prompt of its own
            exist, need = math.perm(10, self.num_digits), self.num_eval + self.num_sft + self.num_preference + \
                self.num_rl_prompts + self.num_process
            if need > exist:
                raise ValueError(f"num_eval + num_sft + num_preference + num_rl_prompts + num_process = {need} "
                                 f"distinct prompts, but "
                                 f"only {exist} orderings of {self.num_digits} distinct digits exist: raise num_digits "
                                 f"or ask for fewer rows")
        if self.task == "boxes" and self.num_process:
            raise ValueError("num_process: the boxes task has no step-labelled solutions; use task: largest_digit, "
                             "or data.source: files with data.process")
        return self


class DatasetSource(Section):
    """User data: a JSONL/Parquet file, or any `datasets` source.

    `path` is a local path or fsspec URI ending in .jsonl/.json/.parquet, or a
    `datasets` name (loaded with `datasets.load_dataset(path, name, split=split)`).
    Rows are either prompt/response (or chosen/rejected) columns, or chat
    messages rendered with the tokenizer's chat template. A preference row
    without the prompt key holds two whole dialogues: chosen/rejected strings
    are split at their last `assistant_marker` (Anthropic HH), message lists
    before their last message (see alignflow/data/formats.py).
    """

    path: str = Field(description="local path or fsspec URI of a .jsonl/.json/.parquet file, or a `datasets` name")
    name: str | None = Field(None, description="`datasets` configuration name; None: the default one")
    split: str = Field("train", description="`datasets` split to load (ignored for files)")
    prompt_key: str = Field("prompt", description="column of the prompt: a string or a list of chat messages")
    response_key: str = Field("response", description="column of the response (SFT rows, unpaired KTO rows)")
    chosen_key: str = Field("chosen", description="column of the preferred response (preference rows)")
    rejected_key: str = Field("rejected", description="column of the dispreferred response (preference rows)")
    messages_key: str | None = Field(
        None, description="column of a chat message list instead of prompt/response columns: sft: its last "
        "(assistant) message is the response; prompts/eval: the whole list is the prompt; None: not used")
    answer_key: str | None = Field(
        "answer", description="column of the reference answer of prompts/eval rows (rule reward, checker); "
        "None, or a row without it: no answer")
    label_key: str | None = Field(
        None, description="preference rows with this key (true: desirable) and a response_key column instead of "
        "chosen/rejected are unpaired examples: preference.loss=kto trains on them too; other stages leave them out")
    assistant_marker: str = Field(
        "\n\nAssistant:", min_length=1, description="preference rows without a prompt key: chosen/rejected "
        "strings are split after their last occurrence of this; the text before (marker included) is the prompt")


class StepwiseSource(DatasetSource):
    """Step-labelled solutions for a process reward model: a prompt, its solution as a list of steps and a label
    per step (TRL's stepwise-supervision rows; Math-Shepherd's and PRM800K's, converted)."""

    steps_key: str = Field("completions", description="column of the solution's steps: a list of strings")
    labels_key: str = Field("labels", description="column of the steps' labels: true/false (or 1/0) per step, "
                            "true where the solution is still right after that step")
    step_separator: str = Field(
        "\n", min_length=1, description="text that follows every step, where the model reads the solution: a step "
        "is scored at its separator's last token, and a round splits responses at it (so no step may hold it)")

    @model_validator(mode="after")
    def _read_here(self) -> StepwiseSource:
        unread = [k for k in ("response_key", "chosen_key", "rejected_key", "answer_key", "label_key",
                              "assistant_marker") if getattr(self, k) != DatasetSource.model_fields[k].default]
        if unread:
            raise ValueError(f"{unread[0]} is not read in data.process, whose rows are a prompt (prompt_key or "
                             f"messages_key), its steps (steps_key) and their labels (labels_key)")
        return self


class CutFractions(Section):
    """The share of a split's rows whose responses may be cut to `max_response_tokens` before the data stage fails."""

    sft: float = Field(0.0, ge=0.0, le=1.0, description="SFT demonstrations")
    preference: float = Field(0.0, ge=0.0, le=1.0, description="a cut pair may lose what tells chosen from rejected")


class DataConfig(Section):
    """Where prompts, demonstrations, preference pairs and eval prompts come from."""

    source: Literal["synthetic", "files"] = Field(
        "synthetic", description="synthetic: the bundled task; files: the sft, preference, eval (and prompts) "
        "sources below")
    synthetic: SyntheticTaskConfig = Field(SyntheticTaskConfig(), description="the bundled task (source: synthetic)")
    sft: DatasetSource | None = Field(None, description="SFT demonstrations (source: files; required there)")
    preference: DatasetSource | None = Field(
        None, description="preference pairs (and unpaired KTO rows), about 10% of them held out (source: files; "
        "required there where a reward model, a preference stage or a judge trains on them)")
    prompts: DatasetSource | None = Field(
        None, description="RL prompts (source: files); None: the SFT prompts, without answers")
    eval: DatasetSource | None = Field(None, description="held-out eval prompts (source: files; required there)")
    process: StepwiseSource | None = Field(
        None, description="step-labelled solutions, about 10% of their prompts held out (source: files; required "
        "there where a process_reward_model trains)")
    max_prompt_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="longer prompts are left out (counted); auto: the longest prompt of any split")
    max_response_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto", description="longer responses are cut (counted); auto: the longest, up to the model's positions")
    max_cut_fraction: CutFractions = Field(
        CutFractions(), description="share of each split's responses that may be cut before the data stage fails")
    preflight_rows: int = Field(
        10000, ge=1, description="rows of a remote data file that preflight parses before anything starts "
        "(every row of a local file is parsed); the data stage checks the rest")

    def sources(self) -> dict[str, str]:
        """Config field -> the path or name of every user source this config reads (none: the bundled task)."""
        if self.source != "files":
            return {}
        return {f"data.{k}.path": src.path for k in ("sft", "preference", "prompts", "eval", "process")
                if (src := getattr(self, k)) is not None}

    def without_process(self) -> DataConfig:
        """This config less the process reward model's data, which a stage of its own reads (tasks/plan.py): the
        data stage's key is the same with or without it."""
        return self.model_copy(update={"process": None,
                                       "synthetic": self.synthetic.model_copy(update={"num_process": 0})})

    def step_separator(self) -> str:
        """What follows every step of a step-labelled solution: data.process's, or the bundled task's."""
        return self.process.step_separator if self.source == "files" and self.process else STEP_SEPARATOR

    @model_validator(mode="after")
    def _labels_only_on_preference(self) -> DataConfig:
        labelled = [k for k in ("sft", "prompts", "eval") if (src := getattr(self, k)) and src.label_key]
        if labelled:
            raise ValueError(f"label_key marks unpaired preference rows (KTO); data.{', data.'.join(labelled)} "
                             f"cannot use it: leave it out there")
        return self

    @model_validator(mode="after")
    def _files_present(self) -> DataConfig:
        if self.source == "synthetic":
            given = [k for k in ("sft", "preference", "prompts", "eval", "process") if getattr(self, k) is not None]
            if given:  # else the run trains on the bundled task, and never reads them
                raise ValueError(f"data.{', data.'.join(given)} {'is' if len(given) == 1 else 'are'} given, but "
                                 f"data.source is 'synthetic' (the bundled task): set data.source: files to read "
                                 f"{'it' if len(given) == 1 else 'them'}")
        if self.source == "files":
            missing = [k for k in ("sft", "eval") if getattr(self, k) is None]  # preference: where read (pipeline.py)
            if missing:
                raise ValueError(f"source='files' needs data.{', data.'.join(missing)}")
        return self
