"""Agentic RL through an OpenAI-compatible proxy: sessions that record every
token the model generated (``sessions``), the HTTP proxy (``proxy``) and the
``agent`` workflow that runs agents against it (``workflow``). Importing this
package imports no torch and no aiohttp."""
