"""The production endpoint: the Serve application (`app`), its settings, the OpenAI ingress and its parts, and the
command line (`python -m serve.production`, `cli`). Its half of the closed loop is `serve/closed_loop/`."""
