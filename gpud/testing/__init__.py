"""Test tools that are not part of the shipped daemon (a stand-in vLLM for tests and the demo)."""
