"""Filter a URL list: drop blacklisted domains, media/archive file extensions, malformed and repeated URLs.

    python data_tools/blacklist_urls.py --input urls.txt --output clean_urls.txt
    python data_tools/blacklist_urls.py --input docs.jsonl --output kept.jsonl --url-key url

Input is a text file of one URL per line, or jsonl with the URL under ``--url-key`` (then whole records
are kept or dropped). ``--domains-file`` adds domains (one per line); a domain also blocks its
subdomains. Summary counts by reason go to stderr. Exit status: 0 done, 1 fatal, 2 usage error.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from urllib.parse import urlsplit

import _common

from megatron_like.config import QuietArgumentParser

# Sites whose links are mostly media, link aggregators or walls of comments (after GPT-2's WebText).
_DEFAULT_DOMAINS_TEXT = (
    "reddit.com redd.it youtube.com youtu.be twitter.com x.com facebook.com instagram.com imgur.com "
    "gfycat.com giphy.com tumblr.com pinterest.com flickr.com vimeo.com twitch.tv tiktok.com "
    "soundcloud.com spotify.com streamable.com vine.co linkedin.com amazon.com ebay.com "
    "docs.google.com drive.google.com dropbox.com mega.nz"
)
DEFAULT_DOMAINS = frozenset(_DEFAULT_DOMAINS_TEXT.split())
_DEFAULT_EXTENSIONS_TEXT = (
    ".jpg .jpeg .png .gif .gifv .bmp .svg .webp .tif .tiff .ico .mp4 .mp3 .webm .avi .mov .mkv .flv .wav "
    ".ogg .m4a .pdf .zip .gz .tgz .tar .rar .7z .exe .dmg .iso .apk .bin .ppt .pptx .doc .docx .xls "
    ".xlsx .psd .torrent"
)
DEFAULT_EXTENSIONS = frozenset(_DEFAULT_EXTENSIONS_TEXT.split())


def url_verdict(url: str, domains: frozenset[str], extensions: frozenset[str]) -> str:
    """Return 'kept' or why ``url`` is dropped: malformed, short, domain, extension."""
    url = url.strip()
    if len(url) < 8:
        return "short"
    try:
        parts = urlsplit(url if "://" in url else "http://" + url)
        host = (parts.hostname or "").lower()
    except ValueError:
        return "malformed"
    if parts.scheme not in ("http", "https") or "." not in host:
        return "malformed"
    labels = host.split(".")
    if any(".".join(labels[i:]) in domains for i in range(len(labels) - 1)):
        return "domain"
    path = parts.path.lower()
    dot = path.rfind(".")
    if dot > path.rfind("/") and path[dot:] in extensions:
        return "extension"
    return "kept"


def main(argv: list[str] | None = None) -> int:
    parser = QuietArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="text file of URLs or jsonl (with --url-key)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--url-key", default=None, help="jsonl field holding the URL")
    parser.add_argument("--domains-file", default=None, help="extra blacklisted domains, one per line")
    parser.add_argument("--no-default-domains", action="store_true")
    parser.add_argument("--keep-repeats", action="store_true", help="keep repeated URLs")
    args = parser.parse_args(argv)
    domains = set() if args.no_default_domains else set(DEFAULT_DOMAINS)
    if args.domains_file:
        with open(args.domains_file, encoding="utf-8") as f:
            domains |= {ln.strip().lower() for ln in f if ln.strip() and not ln.startswith("#")}
    files = _common.input_files_or_exit(args.input) if args.url_key else [args.input]
    counts: Counter = Counter()
    seen: set[str] = set()
    with _common.open_text_out(args.output) as out:
        for _, _, raw in _common.iter_json_docs(files):
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            url = line
            if args.url_key:
                try:
                    url = json.loads(line)[args.url_key]
                    if not isinstance(url, str):
                        raise TypeError
                except (ValueError, KeyError, TypeError):
                    counts["unreadable"] += 1
                    continue
            verdict = url_verdict(url, frozenset(domains), DEFAULT_EXTENSIONS)
            if verdict == "kept" and not args.keep_repeats:
                key = url.strip().rstrip("/")
                if key in seen:
                    verdict = "repeat"
                seen.add(key)
            counts[verdict] += 1
            if verdict == "kept":
                out.write(line.strip() + "\n")
    total = sum(counts.values())
    dropped = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()) if k != "kept") or "none"
    print(f"kept {counts['kept']} of {total} URLs; dropped {dropped}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
