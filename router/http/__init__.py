"""HTTP/1.1 on asyncio.Protocol, both ways: the client port's server and the replicas' client.

Knows nothing of routing.
"""
