"""The OpenAI wire protocol: request/response schemas, chat templates, token text and logprob formatting."""
