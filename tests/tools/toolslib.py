"""Import a script of tools/ as a module (tools/ is not a package).

tools/ goes on ``sys.path`` and the script is imported under its own name, so functions
it hands to spawned processes (``run_distributed``) are importable there too (spawned
children inherit ``sys.path``).
"""
import importlib
import os
import sys

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools")


def load_tool(name: str):
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    return importlib.import_module(name)
