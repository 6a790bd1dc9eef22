"""The detokenizer process: incremental detokenization (`detokenizer`) behind its sockets
(`process`)."""
