"""The stage tasks bound to one pipeline's infra: result storage and retries."""

from __future__ import annotations

from prefect.tasks import exponential_backoff

from alignflow.config import InfraConfig
from flows.runtime import result_storage
from tasks import base_model, data, evaluate, rl_round, train


class StageTasks:
    """Each stage task with this run's result storage and retry policy."""

    def __init__(self, infra: InfraConfig):
        storage = result_storage(infra)
        delay = exponential_backoff(backoff_factor=infra.retry_delay_seconds) if infra.retry_delay_seconds else 0

        def bind(t):
            return t.with_options(result_storage=storage, retries=infra.task_retries, retry_delay_seconds=delay)

        self.prepare_data = bind(data.prepare_data_task)
        self.base_model = bind(base_model.base_model_task)
        self.sft = bind(train.sft_task)
        self.reward_model = bind(train.reward_model_task)
        self.rl_round = bind(rl_round.rl_round_task)
        self.evaluate_policy = bind(evaluate.evaluate_policy_task)
        self.evaluate_reward_model = bind(evaluate.evaluate_reward_model_task)
