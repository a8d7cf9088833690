"""The operator console: web pages the gateway serves at /console for signed-in operators."""
