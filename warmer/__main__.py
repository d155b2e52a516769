from warmer.cli import run

run()
