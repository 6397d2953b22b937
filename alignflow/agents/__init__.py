"""Agents: environments a policy acts in over several turns, and the tools it calls.

    from alignflow.agents import Environment, ToolEnvironment, Tool, tool
"""

from alignflow.agents.environment import Environment, ToolEnvironment, load_environment, make_environment
from alignflow.agents.tools import Tool, ToolOutcome, python, python_tool, run_calls, tool

__all__ = ["Environment", "Tool", "ToolEnvironment", "ToolOutcome", "load_environment", "make_environment", "python",
           "python_tool", "run_calls", "tool"]
