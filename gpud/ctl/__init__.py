"""gpuctl, the command-line client of gpud, as a small package.

    errors.py    exit codes and CtlError: what gpuctl reports and exits with
    client.py    Client over a Transport: the Unix-socket HTTP/1.1 transport, an in-memory one
    format.py    pure formatters: a decoded JSON answer in, the lines a person reads out
    commands.py  the command table (COMMANDS): each command's help, arguments and run function
    main.py      the parser built from the table, and main(): arguments in, exit code out

Startup time is part of the interface (scripts and shell completion call gpuctl in loops): these
modules import nothing but the standard library (``os`` and ``sys`` at the top, the rest where it
is used) and ``gpud.core.vocab``. This file imports nothing.
"""
