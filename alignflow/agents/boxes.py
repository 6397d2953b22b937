"""The bundled agent task: "what code is in box k?", answerable only through a tool.

Each sample hides a few numbered boxes with two-digit codes; the question names one box. The codes are
in the data record the environment reads, never in the prompt: a policy that does not call
`open_box(box)` can only guess (1 in 90). SFT traces (alignflow/data/agent_task.py) open the box and
answer with its code with probability `sft_correct_fraction`; the others show a habit, answering a guess
without calling the tool, so an SFT policy often skips the tool and the GRPO round has to learn to use it.
"""

from __future__ import annotations

from alignflow.agents.environment import ToolEnvironment
from alignflow.agents.tools import Tool

OPEN_BOX = {"type": "function", "function": {
    "name": "open_box", "description": "the code in a box",
    "parameters": {"type": "object", "properties": {"box": {"type": "integer"}}, "required": ["box"]}}}


class BoxesEnvironment(ToolEnvironment):
    def __init__(self) -> None:
        self.tools = [Tool(self.open_box, OPEN_BOX)]

    def open_box(self, box: int) -> str:
        codes = self.sample["boxes"]
        if str(box) not in codes:
            raise KeyError(f"no box {box}")
        return str(codes[str(box)])
