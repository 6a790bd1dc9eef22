"""What crosses between rxf's processes: the typed messages (`messages`), their msgpack codec
(`codec`) and the ipc:// socket addresses (`addresses`)."""
