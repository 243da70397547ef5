from router.run.cli import entry

entry()
