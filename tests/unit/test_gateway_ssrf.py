import asyncio
import ipaddress

import pytest

from gateway.media.ssrf import SSRFError, SSRFGuard, Target, is_public

pytestmark = pytest.mark.unit


def check(guard: SSRFGuard, url: str) -> Target:
    return asyncio.run(guard.check(url))


def fake_resolver(table: dict[str, list[str]]):
    async def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError("Name or service not known")
        return table[host]

    return resolve


@pytest.mark.parametrize(
    "ip",
    ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "0.0.0.0", "224.0.0.1",
     "239.255.255.250", "240.0.0.1", "100.64.0.1", "::1", "fe80::1", "fc00::1", "ff02::1", "::ffff:127.0.0.1",
     "::ffff:10.0.0.1", "::"],
)
def test_non_public_addresses_refused(ip):
    assert not is_public(ipaddress.ip_address(ip))
    host = f"[{ip}]" if ":" in ip else ip
    with pytest.raises(SSRFError, match="non-public"):
        check(SSRFGuard(), f"http://{host}/x.png")


@pytest.mark.parametrize("ip", ["93.184.216.34", "8.8.8.8", "2606:4700::1111"])
def test_public_addresses_pass(ip):
    host = f"[{ip}]" if ":" in ip else ip
    t = check(SSRFGuard(), f"https://{host}/x.png")
    assert t.ip == ip and t.port == 443


def test_hostname_resolving_to_private_is_refused():
    guard = SSRFGuard(resolver=fake_resolver({"evil.example": ["93.184.216.34", "10.0.0.5"]}))
    with pytest.raises(SSRFError, match="10.0.0.5"):
        check(guard, "http://evil.example/a.png")


def test_hostname_resolving_to_public_is_pinned():
    guard = SSRFGuard(resolver=fake_resolver({"cdn.example": ["93.184.216.34"]}))
    t = check(guard, "http://cdn.example:8080/a.png?x=1")
    assert (t.host, t.port, t.ip) == ("cdn.example", 8080, "93.184.216.34")
    assert t.pinned_url() == "http://93.184.216.34:8080/a.png?x=1"


def test_ipv6_pinned_url_has_brackets():
    t = check(SSRFGuard(), "http://[2606:4700::1111]/a")
    assert t.pinned_url() == "http://[2606:4700::1111]:80/a"


def test_allowed_cidr_and_ip_and_hostname():
    guard = SSRFGuard(
        ["10.0.0.0/8", "127.0.0.1", "media.internal"],
        resolver=fake_resolver({"media.internal": ["192.168.5.5"], "other.internal": ["192.168.5.6"]}),
    )
    assert check(guard, "http://10.9.9.9/a").ip == "10.9.9.9"
    assert check(guard, "http://127.0.0.1:9000/a").ip == "127.0.0.1"
    assert check(guard, "http://media.internal/a").ip == "192.168.5.5"
    with pytest.raises(SSRFError):
        check(guard, "http://127.0.0.2/a")
    with pytest.raises(SSRFError):
        check(guard, "http://other.internal/a")


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://93.184.216.34/a", "gopher://x/", "//x/a"])
def test_other_schemes_refused(url):
    with pytest.raises(SSRFError, match="scheme"):
        check(SSRFGuard(), url)


def test_credentials_and_unresolvable_refused():
    with pytest.raises(SSRFError, match="credentials"):
        check(SSRFGuard(), "http://user:pw@93.184.216.34/")
    with pytest.raises(SSRFError, match="cannot resolve"):
        check(SSRFGuard(resolver=fake_resolver({})), "http://nowhere.invalid/")


def test_localhost_resolves_and_is_refused():
    with pytest.raises(SSRFError, match="non-public"):
        check(SSRFGuard(), "http://localhost:1/x")


@pytest.mark.parametrize("ip,public", [("64:ff9b::7f00:1", False), ("64:ff9b::808:808", True),
                                       ("2002:a00:1::", False), ("2002:808:808::", True)])
def test_ipv6_embedding_ipv4_judged_by_the_ipv4(ip, public):
    assert is_public(ipaddress.ip_address(ip)) is public


@pytest.mark.parametrize("addr", ["fec0::1", "fed0:1::2", "feff:ffff::1"])
def test_site_local_ipv6_is_private(addr):
    # fec0::/10 (site-local, RFC 3879) reaches hosts inside a site; Python 3.11's ipaddress
    # calls it global, so the guard must refuse it itself
    assert not is_public(ipaddress.ip_address(addr))
    with pytest.raises(SSRFError, match="non-public"):
        check(SSRFGuard(), f"http://[{addr}]/x.png")
    guard = SSRFGuard(resolver=fake_resolver({"site.example": [addr]}))
    with pytest.raises(SSRFError, match="non-public"):
        check(guard, "http://site.example/x.png")
    assert check(SSRFGuard(allowed=["fec0::/10"]), f"http://[{addr}]/x.png").ip == addr


def test_just_outside_site_local_is_judged_as_before():
    assert is_public(ipaddress.ip_address("2606:4700::1111"))
    assert not is_public(ipaddress.ip_address("febf::1"))  # link-local fe80::/10, refused already
