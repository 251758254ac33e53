from funcpar.cli.main import entry

entry()
