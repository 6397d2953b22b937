"""The HF rollout engine: transformers `generate`, the benchmark baseline and a fallback a user can choose
(generation.backend: hf). The interface is engines/rollout/base.py's."""

from __future__ import annotations

import torch

from engines.rollout.base import Rollout, Sampling, SleepState
from engines.rollout.texts import response_texts
from engines.transport.wire import TransportGroup, check_specs, plan_buckets, receive_buckets


class PickedLogprobs:
    """A logits processor, last in `generate`'s list, keeping the log-prob of each sampled token under the scores
    it was drawn from (after temperature and top_p: vLLM's processed_logprobs, engines/rollout/vllm_engine.py).
    One step's log-softmax is held until the next step shows the token it drew, so memory is one (rows, vocab)
    matrix, where `output_scores` kept every step's scores (rows x new tokens x vocab floats: 40 GB for 512
    rows of 128 tokens over Qwen's 151,936) and a log-softmax of them all beside it."""

    def __init__(self):
        self.last, self.picked = None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1])
        self.last = torch.log_softmax(scores.float(), -1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self.last is not None:
            self.picked.append(self.last.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
            self.last = None

    def of(self, sequences: torch.Tensor) -> torch.Tensor:
        """(rows, new tokens) log-probs of `sequences`, the generated tokens: the last step's token is drawn
        now, unless generate undid steps it had run (its deferred stop checks), whose log-probs are dropped."""
        if len(self.picked) < sequences.shape[1]:
            self._take(sequences[:, -1])
        return torch.stack(self.picked[: sequences.shape[1]], 1)


class HFEngine(SleepState):
    """transformers `generate`: the baseline in benchmarks, a user-selectable fallback.

    Seeded once, at construction, in its own actor process (as vLLM seeds its
    engine): successive calls draw fresh samples, and the same seed replays the
    same sequence of calls. On a GPU, sleeping moves the weights to CPU memory
    and waking brings them back; on the CPU only the state changes (SleepState).
    """

    def __init__(self, model_path: str, *, dtype: str = "float32", seed: int = 0, attn_implementation: str = "sdpa",
                 **_):
        from engines.models import load_policy, load_tokenizer, weight_shapes
        from engines.placement.devices import actor_device

        from transformers import GenerationConfig

        torch.manual_seed(seed)
        self.device = actor_device()
        self.model = load_policy(model_path, dtype, attn_implementation).to(self.device).eval()
        self.tokenizer = load_tokenizer(model_path)
        self._shapes = weight_shapes(self.model)
        # Every end-of-sequence id, as vLLM stops at: the tokenizer's and the checkpoint's generation config's
        # (an instruct model's end of turn and its <|endoftext|>).
        own = self.model.generation_config.eos_token_id
        self.eos_ids = sorted({self.tokenizer.eos_token_id, *(own if isinstance(own, list) else [own] if own is not None
                                                              else [])})
        # Nothing from the checkpoint's generation config (an instruct model's repetition_penalty, top_k, ...):
        # transformers would apply it under the settings passed, so the samples and their log-probs would be of
        # a distribution other than the round's, and than vLLM's.
        self.model.generation_config = GenerationConfig(pad_token_id=self.tokenizer.pad_token_id,
                                                        eos_token_id=self.eos_ids)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> list[Rollout]:
        self._awake("generate", needs=self.TAGS)
        tok = self.tokenizer
        width = max(len(p) for p in prompt_ids)
        # Left padding so every prompt ends where generation starts.
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt_ids], device=self.device)
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=self.device)
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        picked = PickedLogprobs()
        warpers = [TemperatureLogitsWarper(sampling.temperature)] if 0 < sampling.temperature != 1 else []
        warpers += [TopPLogitsWarper(sampling.top_p)] if sampling.temperature > 0 and sampling.top_p < 1 else []
        seqs = self.model.generate(
            input_ids=ids, attention_mask=attn, do_sample=sampling.temperature > 0,
            # Temperature and top_p as processors of our own, ahead of `picked`: transformers puts a caller's
            # processors before the warpers it makes itself, so `picked` would see the scores unwarped.
            temperature=None, top_p=None, logits_processor=LogitsProcessorList([*warpers, picked]),
            top_k=0,  # transformers defaults to 50: sample the full distribution, as vLLM does
            max_new_tokens=sampling.max_new_tokens, num_return_sequences=sampling.n,
            min_new_tokens=sampling.max_new_tokens if sampling.ignore_eos else None,
            pad_token_id=tok.pad_token_id, eos_token_id=self.eos_ids,
        )[:, width:]
        picked = picked.of(seqs).cpu()
        seqs = seqs.cpu()
        rows = []
        for row in range(seqs.shape[0]):
            toks = seqs[row].tolist()
            ends = [i for i, t in enumerate(toks) if t in self.eos_ids]
            stop = bool(ends) and not sampling.ignore_eos
            end = ends[0] + 1 if stop else len(toks)
            rows.append((row // sampling.n, toks[:end], picked[row, :end].tolist(), stop))
        texts = response_texts(tok, [list(prompt_ids[i]) for i, *_ in rows], [toks for _, toks, *_ in rows])
        return [Rollout(prompt_index=i, prompt_ids=list(prompt_ids[i]), token_ids=toks, text=text, logprobs=lps,
                        finished=stop) for (i, toks, lps, stop), text in zip(rows, texts)]

    # ---- turn by turn (episodes): what is queued generates together at the next step ----

    def add(self, key, prompt_ids: list[int], sampling: Sampling) -> None:
        self.refuse_asleep("generate", needs=self.TAGS)
        self.__dict__.setdefault("_queued", []).append((key, list(prompt_ids), sampling))

    def busy(self) -> bool:
        return bool(self.__dict__.get("_queued"))

    def abort(self, keys: list) -> None:
        self._queued = [q for q in self.__dict__.get("_queued", []) if q[0] not in set(keys)]

    def step(self) -> list[tuple[object, list[int], list[float], bool]]:
        """Every queued sample, generated in one batch per sampling setting: (key, token ids, logprobs, EOS)."""
        queued, self._queued = self._queued, []
        done = []
        for sampling in dict.fromkeys(s for _, _, s in queued):
            group = [(k, p) for k, p, s in queued if s == sampling]
            for (key, _), r in zip(group, self.generate([p for _, p in group], sampling)):
                done.append((key, r.token_ids, r.logprobs, r.finished))
        return done

    def prepare_weights(self, specs: list, bucket_bytes: int) -> list[str | None]:
        """Check the names and shapes updates will carry (once): those of this model's own weight set
        (`models.weight_shapes`), where a tied output layer travels once, as the embedding it shares.
        The GPU that will receive them (None on the CPU)."""
        from engines.transport.sync import gpu_id

        check_specs(self._shapes, specs, "HF rollout engine")
        self._buckets = plan_buckets(specs, bucket_bytes)
        return [gpu_id(self.device)]

    def join_transport(self, address: tuple[str, int], first_rank: int, world_size: int, backend: str) -> None:
        self._group = TransportGroup(tuple(address), first_rank, world_size, backend, self.device)

    @torch.no_grad()
    def receive_weights(self) -> None:
        """Load an update in place, tensor by tensor as the buckets arrive."""
        self._awake("update weights", needs=("weights",))
        own = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
        device = "cpu" if self._group.backend == "gloo" else self.device
        for name, tensor in receive_buckets(self._group, self._buckets, device):
            own[name].copy_(tensor)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # returned: the weights are in place

    def sleep(self) -> None:
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._sleeping()

    def wake(self, tags: list[str] | None = None) -> None:
        weights_slept = "weights" in self.asleep
        if "weights" in self._woken(tags) and weights_slept and self.device.type == "cuda":
            self.model.to(self.device)

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def device_report(self) -> dict[str, list[str]]:
        return {"policy": sorted({p.device.type for p in self.model.parameters()})}
