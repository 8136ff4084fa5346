#!/usr/bin/env bash
# Generates throw-away TLS material for a test broker: `scripts/gen_test_certs.sh DIR [HOST...]`.
#
#   DIR/ca.pem            the test CA certificate (clients trust this: INFERLINE_KAFKA__SSL_CAFILE)
#   DIR/ca.key            the CA's private key (only to sign; never leaves DIR)
#   DIR/broker.pem        the broker certificate, signed by the CA, SAN = localhost, 127.0.0.1 and HOSTs
#   DIR/broker.key        its private key (PKCS#8, unencrypted, mode 600)
#   DIR/broker.p12        key + certificate chain as a PKCS#12 keystore for the broker (Java)
#   DIR/keystore.password the keystore's password (random, mode 600)
#   DIR/other-ca.pem      an unrelated CA (for "a client that does not trust the broker" tests)
#
# Valid for 2 days; RSA 2048. Existing files are kept (delete DIR to regenerate). Test use only.
set -euo pipefail

DIR=${1:?usage: $0 DIR [HOST...]}
shift || true
HOSTS=(localhost "$@")
DAYS=2

say() { echo "gen_test_certs.sh: $*" >&2; }
command -v openssl >/dev/null || { say "error: openssl is needed"; exit 1; }

mkdir -p "$DIR"
chmod 700 "$DIR"
cd "$DIR"
umask 077

if [ -f broker.p12 ] && [ -f ca.pem ] && [ -f keystore.password ] && [ -f other-ca.pem ]; then
    say "keeping the certificates in $DIR"
    exit 0
fi

make_ca() {  # NAME CN
    openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days "$DAYS" -keyout "$1.key" -out "$1.pem" \
        -subj "/CN=$2" -addext "basicConstraints=critical,CA:TRUE" \
        -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

make_ca ca "inferline test CA"
make_ca other-ca "unrelated test CA"
rm -f other-ca.key

san="IP:127.0.0.1"
for h in "${HOSTS[@]}"; do san="$san,DNS:$h"; done
openssl req -newkey rsa:2048 -nodes -sha256 -keyout broker.key -out broker.csr \
    -subj "/CN=localhost" 2>/dev/null
cat >broker.ext <<EOF
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=$san
EOF
openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days "$DAYS" -sha256 \
    -extfile broker.ext -out broker.pem 2>/dev/null
rm -f broker.csr broker.ext ca.srl

openssl rand -hex 16 >keystore.password
openssl pkcs12 -export -in broker.pem -inkey broker.key -certfile ca.pem -name broker \
    -out broker.p12 -passout "file:keystore.password"
chmod 600 ./*.key keystore.password broker.p12
chmod 644 ca.pem other-ca.pem broker.pem
say "wrote the test CA and broker certificate to $DIR (SAN $san)"
