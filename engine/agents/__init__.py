"""Agents: tools and tool choice (tools.py), each family's tool-call format parsed and enforced
(parsers.py), reasoning channels split out (reasoning.py). Transport-free (docs/tools.md)."""
