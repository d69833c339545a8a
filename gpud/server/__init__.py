"""What gpud answers: the HTTP/JSON API on the Unix socket (`api`, `views`, `responses`,
`openapi`), the answer to the on-demand check the front and router ask before a request
(`ondemand`: the orchestrator's outcome or refusal as a response; its decisions and waits are
gpud.life.ondemand's), the
Prometheus exposition (`metrics`) and the guard on each peer's connections (`connguard`).

The top floor of adapters: it may import every floor below (`gpud.vllm`, `gpud.durable`,
`gpud.host`, `gpud.nginx`, `gpud.life`) and the pure core. Only `gpud.daemon` wires it.
"""
