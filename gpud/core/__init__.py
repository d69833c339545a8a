"""gpud's pure core: decisions from values to values. No I/O, no clock, no asyncio.

The ground floor: it may import the standard library's pure modules, pydantic for its types and
`gpud.errors`, nothing else of gpud (tests/test_core_purity.py walks every import it runs).
"""
