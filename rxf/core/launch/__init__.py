"""Starting the engine's child processes and watching them (`processes`, in the main process), the
entry every child starts through (`child`), and the logging each process sets up."""
