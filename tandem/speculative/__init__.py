"""Speculative decoding: proposals (n-gram over the request's own tokens, a draft model) and
their exact verification by the target model. See docs/async-model.md, "Speculative decoding".
"""
