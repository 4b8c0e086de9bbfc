"""`python -m engine.chat`: the chat session (engine/chat/session.py)."""

import sys

from engine.chat.session import main

sys.exit(main())
