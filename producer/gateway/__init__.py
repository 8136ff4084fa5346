"""An OpenAI-compatible HTTP gateway in front of the Kafka fleet (docs/gateway.md).

A trusted producer: it maps API keys to tenants, OpenAI requests to contract requests, and reply
events back to OpenAI responses and SSE chunks. Instances run side by side.

    app.py              FastAPI routes and the lifespan
    service.py          one request's life: key, body, publish, whole answer or stream, hang-up
    sse.py              the SSE response that notices a hang-up while nothing is sent
    openai_mapping.py   OpenAI request body -> contract request fields
    openai_responses.py contract results -> OpenAI JSON bodies and stream chunks
    follower.py         reply events of every attempt -> text to send, each character once
    clients.py          one InferenceClient per tenant; requests in flight; cancel on hang-up
    auth.py             API keys -> tenants
    errors.py           OpenAI's error shape and the status of each failure
    metrics.py          the gateway's Prometheus metrics (its own registry)
    server.py           uvicorn, with in-flight requests cancelled on shutdown
"""
