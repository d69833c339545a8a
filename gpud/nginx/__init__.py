"""The data path's configuration: the front, the nginx that fronts serves on their ports
(`front`), and the router, one OpenAI-compatible address that routes by the body's `model`
(`router`). gpud renders their config and runs nginx as a unit; the requests themselves never pass
through gpud's event loop (a gpud restart cuts no request).

They may import `gpud.core`, the root modules and the floors below (`gpud.vllm`, `gpud.durable`,
`gpud.host`); not a serve's life (`gpud.life`) nor the API (`gpud.server`).
"""
