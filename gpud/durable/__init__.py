"""What outlives gpud's process: the SQLite store of the ledger, states, events and calibrations
(`store`), and journald, where every event is also written with its structured fields (`journal`).

They may import `gpud.core`, the root modules (`gpud.errors`, `gpud.files`, `gpud.bounded`,
`gpud.config`) and `gpud.vllm`; nothing that runs serves, answers requests or observes devices.
"""
