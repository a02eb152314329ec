"""IncA on Flower's deployment engine: the test app of tests/test_deployment.py."""
