"""A serve's life under the ledger: each serve's one record in memory (`records`), the ledger
service that decides admissions, holds and reloads (`service`) on the write path that commits every
change with its state and event in one transaction, group by group (`writes`), the
supervisor's jobs (`supervisor/`: launch, boot,
health, stop, watch), sleeping (`sleeping`) and preemption (`preemption`), what a sleeping serve says it is
(`reconciling`), the rebalance and its executor (`rebalance`, `steps`, `planning`, `offload`),
calibration (`calibration`), alerts from observation (`alerts`), what is in flight on each serve
(`traffic`: what a read changes, when a drain is over; the read is gpud.host.traffic's), the
on-demand orchestrator (`ondemand`: bring-ups for requests through the front,
the router's queue and its evictions; `idle`: the idle check; `demandview`: what they read;
`counts`: what they did, for the metrics), and the coordination they share (`locks`, `pulse`).

The decisions are the pure core's (`gpud.core`); these modules carry them out. They may import
`gpud.core`, the root modules and every floor below (`gpud.vllm`, `gpud.durable`, `gpud.host`,
`gpud.nginx`); never `gpud.server`.
"""
