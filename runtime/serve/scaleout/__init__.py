"""Scale-out on Ray Serve: engine replicas behind the OpenAI server, routed by cached prefix.

`routing.py` (the scoring) is standard library, shared with the routing simulation; the other
modules import Ray and are loaded only by `ruvllm serve --ray` or a `serve run` config.
"""
