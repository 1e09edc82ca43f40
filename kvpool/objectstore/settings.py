"""Where the object tier is and how to reach it: `s3://BUCKET/PREFIX`, with the endpoint, region and credentials
read as the AWS tools read them (environment first, then the shared credentials and config files).

    AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3)          the S3 endpoint; unset: AWS's own for the region
    AWS_REGION (or AWS_DEFAULT_REGION)                  default us-east-1
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN
    AWS_SHARED_CREDENTIALS_FILE (~/.aws/credentials), AWS_CONFIG_FILE (~/.aws/config), AWS_PROFILE (default)

The URL's one option, `?encryption=aes-gcm`, has every object written there encrypted and authenticated
(kvpool/objectstore/sealing.py); readers then refuse any that is not. No I/O beyond reading those files; a bad
value is a ValueError naming it and what to give instead.
"""

import configparser
import dataclasses
import os
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

SCHEME = "s3://"
DEFAULT_REGION = "us-east-1"
# S3's bucket naming rules (the part kvpool checks: length and characters; AWS checks the rest)
_BUCKET_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789.-")
ENCRYPTION = "aes-gcm"  # the one value of ?encryption= (kvpool/objectstore/sealing.py)


@dataclasses.dataclass(frozen=True)
class ObjectStoreSettings:
    bucket: str
    prefix: str  # "" or "a/b/" (always ending in "/" when not empty): every object's name begins with it
    endpoint: str | None
    region: str
    access_key_id: str | None
    secret_access_key: str | None = dataclasses.field(repr=False, default=None)
    session_token: str | None = dataclasses.field(repr=False, default=None)
    encryption: str | None = None  # ENCRYPTION when what is written there is encrypted

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}" + (f"?encryption={self.encryption}" if self.encryption else "")

    def store_config(self) -> dict:
        """obstore's S3Store keywords for these settings (credentials left out when none are given: obstore then
        looks for the instance's or container's own)."""
        config = {"region": self.region}
        if self.endpoint:
            config["endpoint"] = self.endpoint
        if self.access_key_id:
            config["access_key_id"] = self.access_key_id
            config["secret_access_key"] = self.secret_access_key or ""
        if self.session_token:
            config["session_token"] = self.session_token
        return config


def parse_url(url: str) -> tuple[str, str, str | None]:
    """(bucket, prefix, encryption) of s3://BUCKET[/PREFIX][?encryption=aes-gcm]."""
    if not isinstance(url, str) or not url.startswith(SCHEME):
        raise ValueError(f"object store {url!r}: give s3://BUCKET/PREFIX (or `local` to `kvpool up`)")
    parts = urlsplit(url)
    bucket, prefix = parts.netloc, parts.path.strip("/")
    try:
        options = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)))
    except ValueError:
        options = {"": parts.query}
    if parts.fragment or set(options) - {"encryption"} or options.get("encryption", ENCRYPTION) != ENCRYPTION:
        raise ValueError(f"object store {url!r}: the one option is ?encryption={ENCRYPTION} "
                         "(s3://BUCKET/PREFIX[?encryption=aes-gcm])")
    if not 3 <= len(bucket) <= 63 or not set(bucket) <= _BUCKET_CHARS or bucket[0] in ".-" or bucket[-1] in ".-":
        raise ValueError(f"object store {url!r}: {bucket!r} is not a bucket name (3 to 63 of a-z, 0-9, '.', '-')")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise ValueError(f"object store {url!r}: the prefix {prefix!r} has an empty, '.' or '..' part")
    return bucket, prefix + "/" if prefix else "", options.get("encryption")


def settings_for(url: str, environ: dict | None = None) -> ObjectStoreSettings:
    """The settings for `url`, reading the environment (default os.environ) and the AWS files it names."""
    env = os.environ if environ is None else environ
    bucket, prefix, encryption = parse_url(url)
    profile = env.get("AWS_PROFILE") or "default"
    files = _profile(env, profile)
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or files.get("endpoint_url")
    if endpoint:
        scheme = urlsplit(endpoint).scheme
        if scheme not in ("http", "https") or not urlsplit(endpoint).netloc:
            raise ValueError(f"AWS_ENDPOINT_URL {endpoint!r}: give http(s)://HOST[:PORT]")
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or files.get("region") or DEFAULT_REGION
    key = env.get("AWS_ACCESS_KEY_ID")
    if key:
        secret, token = env.get("AWS_SECRET_ACCESS_KEY"), env.get("AWS_SESSION_TOKEN")
    else:
        key, secret, token = (files.get("aws_access_key_id"), files.get("aws_secret_access_key"),
                              files.get("aws_session_token"))
    if key and not secret:
        raise ValueError("an AWS access key id without its secret: set AWS_SECRET_ACCESS_KEY (or "
                         "aws_secret_access_key in the credentials file)")
    return ObjectStoreSettings(bucket, prefix, endpoint, region, key, secret, token, encryption)


def _profile(env, profile: str) -> dict:
    """The profile's keys from the shared credentials file, then its config file (whose sections are
    `profile NAME`, but `default`)."""
    home = Path(env.get("HOME") or Path.home())
    found = {}
    sources = ((env.get("AWS_CONFIG_FILE") or home / ".aws" / "config",
                profile if profile == "default" else f"profile {profile}"),
               (env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials", profile))
    for path, section in sources:  # credentials last: they win, as with the AWS tools
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except configparser.Error as exc:
            raise ValueError(f"{path}: not an AWS config file ({exc})") from None
        if parser.has_section(section):
            found.update(parser.items(section))
    return found
