"""Running the system: the `pacer` command line, the in-process engine, process supervision."""
