"""The command line: ``span-workflows`` and its subcommands (entry: :func:`main.main`)."""
