"""``python -m webhook``: the same as the ``csinode-guard`` console command."""

from webhook.cli import main

if __name__ == "__main__":
    main()
