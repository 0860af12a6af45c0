"""The base layer: what every other layer needs and that needs nothing else of perseus (exception types, the
table of settings, reduction ops, partition arithmetic, Horovod's ``util`` helpers, the import alias, and the
formats the elastic launcher and the ranks share). It never loads the engine or MPI."""
