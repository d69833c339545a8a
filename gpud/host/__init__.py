"""The host and its devices, as adapters: NVML and the simulated GPU (`nvml`, `simulation`),
observation on the event loop's edge (`observer`, `cgroups`), systemd's service manager over
D-Bus, its names and error mapping, and the typed table of unit properties (`units`,
`unitbus`, `unit_properties`), who holds a port (`ports`), a serve's count of requests in
flight from its /metrics (`traffic`), containers and CDI (`containers`, `cdi`) and the host's
RAM as a budget (`hostmem`).

Each module here reports what the host says and carries out what it is told; none decides a
serve's state. They may import `gpud.core`, the root modules, `gpud.vllm` and `gpud.durable`.
"""
