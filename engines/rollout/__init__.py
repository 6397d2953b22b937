"""Generation: rollout engines behind one small interface (`base`).

vLLM (`vllm_engine`) and the HF fallback (`hf_engine`), each hosted by a Ray actor (`actors`), or built
one after another in one process for evaluations (`host`); response text decoded once (`texts`). It uses
placement, transport and the shared model pieces; it never imports training or the RL round.
"""
