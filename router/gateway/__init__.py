"""One request from client to replica: dispatch, keys, bodies, the retry chain, holds, attempts, answers."""
