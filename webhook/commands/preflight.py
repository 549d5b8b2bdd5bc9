"""x"""
import click
@click.command("preflight")
def preflight() -> None:
    """x"""
