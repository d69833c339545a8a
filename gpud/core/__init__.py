"""gpud's pure core: decisions from values to values. No I/O, no clock, no asyncio."""
